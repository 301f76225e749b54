"""
Benchmark of the sampling loop in rollout.py against the diffusers pipelines it replaces.

    python bench_rollout.py                                   # CPU: digits + tiny random pipelines
    python bench_rollout.py --device cuda                     # one GPU, bfloat16
    python bench_rollout.py --backbones sd35m --model-path /models/sd35m --steps 10 --batch 8

For each diffusers backbone it times `Backbone.sample` and the pipeline's own call on the same default
schedule, prompt embeddings, initial latents and batch (output_type="latent", so no decode on either
side), and prints the largest relative difference of the two outputs. For digits it prints rollouts
per second of `sample` and the cost of the reference solve. Names ending in -tiny are the randomly
initialised components of tests/test_rollout_diffusers.py.
"""
import argparse
import math
import time

import torch

import rollout

# ---- configuration
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--backbones", default="digits,sd3-tiny,flux-tiny,sdxl-tiny", help="comma-separated names")
parser.add_argument("--model-path", default=None, help="local diffusers folder for a real backbone")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--steps", type=int, default=4, help="L, model calls per rollout")
parser.add_argument("--batch", type=int, default=4, help="rollouts per call for the diffusers backbones")
parser.add_argument("--digits-rollouts", type=int, default=64, help="rollouts per call for digits")
parser.add_argument("--repeats", type=int, default=10, help="timed calls after one warm-up; the best is shown")


def timed(functions, repeats, device):
    """Best wall time in ms of each function over `repeats` interleaved calls after one warm-up (the
    minimum: on a shared machine other processes only ever add time), and each one's last result."""
    results = [function() for function in functions]
    best = [math.inf] * len(functions)
    for _ in range(repeats):
        for index, function in enumerate(functions):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            results[index] = function()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[index] = min(best[index], 1e3 * (time.perf_counter() - started))
    return best, results


def bench_digits(config, device):
    backbone = rollout.load_backbone("digits", device=device)
    count = config.digits_rollouts
    cond = backbone.encode_prompts([backbone.prompts[i % 10] for i in range(count)])
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(0))
    for steps in sorted({config.steps, 10}):
        times = backbone.default_times(steps).expand(count, -1)
        (milliseconds,), _ = timed([lambda: backbone.sample(noise, cond, times)], config.repeats, device)
        rate = 1e3 * count / milliseconds
        print(f"digits    L={steps:<3d} {count} rollouts: {milliseconds:8.2f} ms  ({rate:,.0f} rollouts/s)")
    (milliseconds,), _ = timed([lambda: backbone.reference(noise, cond)], 1, device)
    print(f"digits    reference (RK4, {rollout.DIGIT_REFERENCE_STEPS} steps) for {count}: {milliseconds:8.1f} ms")


def tiny_backbone(name, device, dtype):
    from tests.test_rollout_diffusers import BUILDERS, GUIDANCE, RESOLUTION

    family = {"sd3-tiny": "sd3", "flux-tiny": "flux-dev", "sdxl-tiny": "sdxl"}[name]
    pipe = BUILDERS[family]().to(device)
    if dtype != torch.float32:
        pipe.to(dtype)
    return rollout.from_pipeline(pipe, resolution=RESOLUTION, guidance=GUIDANCE[family])


def bench_pipeline(name, config, device):
    if name.endswith("-tiny"):
        backbone = tiny_backbone(name, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    else:
        backbone = rollout.load_backbone(name, path=config.model_path, device=device)
    pipe, count, steps = backbone.pipe, config.batch, config.steps
    prompts = [f"a photograph of object number {i} on a table" for i in range(count)]
    (encode_ms,), (cond,) = timed([lambda: backbone.encode_prompts(prompts)], 1, device)
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(0))
    times = backbone.default_times(steps).expand(count, -1)
    # the pipeline gets the same embeddings, so both sides time the denoising loop alone
    embeddings = {key: value for key, value in cond.items() if key.endswith("prompt_embeds")}
    guidance = 0.0 if backbone.guidance is None else backbone.guidance

    def loop():
        return backbone.sample(noise, cond, times)

    def pipeline():
        return pipe(**embeddings, num_inference_steps=steps, guidance_scale=guidance, height=backbone.resolution,
                    width=backbone.resolution, latents=noise.to(backbone.dtype).clone(), output_type="latent").images

    (loop_ms, pipe_ms), (ours, theirs) = timed([loop, pipeline], config.repeats, device)
    difference = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
    print(f"{name:<12s} L={steps} batch={count} {backbone.resolution}px {str(backbone.dtype):>14s}: "
          f"loop {loop_ms:8.1f} ms, "
          f"pipeline {pipe_ms:8.1f} ms (loop/pipeline {loop_ms / pipe_ms:.2f}), encode {encode_ms:.1f} ms, "
          f"max relative difference {difference:.1e}")


if __name__ == "__main__":
    config = parser.parse_args()
    device = torch.device(config.device)
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} CPU threads")
    for name in config.backbones.split(","):
        if name == "digits":
            bench_digits(config, device)
        else:
            bench_pipeline(name, config, device)
