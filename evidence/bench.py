"""
Benchmarks that print numbers: what the policy costs against the sampler, the sampling loop against
the diffusers pipelines it replaces, and the embedded backbone's throughput; each report also goes
to docs/RESULTS.md (section "bench <benchmark> on <device>").

    python -m evidence.bench  # CPU: all three, tiny random pipelines (about a minute)
    python -m evidence.bench --only policy  # FLOPs and parameter counts (meta device, no weights)
    python -m evidence.bench --only loop --device cuda  # one GPU, bfloat16
    python -m evidence.bench --only loop --backbones sd35m --model-path /models/sd35m --steps 10 \
        --batch 8
    python -m evidence.bench --only threads  # the main job at 1 thread and at torch's default
    python -m evidence.bench --only ocr  # OCR reward's time per image
    python -m evidence.bench --only inference --backbones digits,mini-sd3 --steps 3  # vs TPDM
    python -m evidence.bench --only iteration --backbones digits-prompt,mini-sd3  # s / iteration
    python -m evidence.bench --gpu  # one GPU: SD3.5-M, SD3.5-L, SD-XL, Flux-Dev, random weights
    python -m evidence.bench --gpu --tiny  # the same code, tiny layouts, CPU; records nothing

policy: FLOPs of one SD3.5-Medium transformer step at 1024^2 with CFG against one policy call,
counted on the meta device (shapes only), and the parameters of each policy size. loop: for each
diffusers backbone, `Backbone.sample` and the pipeline's own call timed on the same default
schedule, prompt embeddings, initial latents and batch (output_type="latent", no decode on either
side), and the largest relative difference of their outputs. embedded: rollouts per second and the
teacher's cost. threads: `python train.py` (the main job) at 1 CPU thread and at torch's default,
one after the other in this run, with the difference of their held-out results; then both again for
a few iterations while another process keeps every core busy. ocr: the OCR reward's time per image
on rendered text at 512^2 and 1024^2, after a warm-up call. inference: for each backbone named
(embedded or miniature, or a real one with --model-path), sampling N images with the default
schedule (the model calls alone), with the single-pass policy (one policy call, then the loop) and
with the step-wise policy (one policy call after each model call), interleaved in one run; the
policy's share of each and the step-wise / single-pass time. The policy's cost does not depend on
its weights, so freshly initialised policies are timed. iteration: `train.py` for a few iterations
per training (global, instance, step-wise with REINFORCE + JS, step-wise with PPO) one after the
other on each backbone named, at its defaults; the median wall time of an iteration.
Names ending in -tiny are the randomly initialised pipelines of miniatures/layouts.py.

gpu: each real backbone (SD3.5-Medium, SD3.5-Large, SD-XL, FLUX.1-dev) as its published
configurations lay it out, at random weights built directly on the GPU in bfloat16 (no download,
no files; the tokenizers are built offline), trained by train.py's main at its preset for a few
iterations with B = 8 contexts, and HPSv2's architecture at random weights as the reward (a
weightless one where hpsv2 is missing; the report says which). For each: the components'
parameter counts, seconds per iteration, the peak GPU memory of the load (with train.py's setup),
of the training loop and of the held-out report, the largest batch the frozen model saw (its
--rollout-batch, doubled under CFG), and an iteration's time per image (the best of those between
the first and the last) against the stock pipeline's own call for as many images at the same steps,
decoded (the best of as many calls after a warm-up). Random weights cost what the real ones do;
their images mean nothing.
--tiny runs the same code on the CPU with the same layouts scaled down (and the policy at the
embedded size): a check of the code that records nothing.

On a GPU machine with torch but without diffusers or a network: build the wheels where pip
reaches PyPI, copy the folder of wheels into the checkout there, and run with them on the path:

    pip wheel --no-deps -w wheels diffusers==0.42.1 importlib_metadata
    pip wheel --no-deps -w wheels hpsv2x==1.2.0 ftfy wcwidth clint args  # HPSv2's architecture
    pip install --no-index --no-deps --target /tmp/site wheels/*.whl  # there, in the checkout
    PYTHONPATH=/tmp/site python -m evidence.bench --gpu
"""

import argparse
import contextlib
import gc
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

import backbones
from evaluate import POLICIES, default_schedule, load_policy, policy_schedule, run_method
from evidence.results import REPOSITORY, commit, record
from miniatures.layouts import TINY_GUIDANCE, TINY_RESOLUTION, tiny_pipeline, tiny_text
from policy import NETWORKS, make_policy
from prompts import context_noise, heldout_contexts, load_prompt_file
from rewards import load_reward

parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
add = parser.add_argument
add(
    "--only",
    choices=["policy", "loop", "embedded", "floor", "threads", "ocr", "inference", "iteration"],
    default=None,
    help="one benchmark; default: all but threads and ocr",
)
add(
    "--backbones",
    help="loop (default sd3-tiny,flux-tiny,sdxl-tiny), inference (digits,mini-sd3), "
    "gpu (sd35m,sd35l,sdxl,flux-dev)",
)
add("--gpu", action="store_true", help="the real backbones' sizes at random weights on one GPU")
add("--tiny", action="store_true", help="with --gpu: tiny layouts on the CPU, nothing recorded")
add("--model-path", default=None, help="loop: local diffusers folder of a real backbone")
add("--device", default=None, help="default: cuda when available, else cpu")
add("--steps", type=int, default=4, help="L, model calls per rollout")
add("--batch", type=int, default=4, help="loop: rollouts per call")
add("--repeats", type=int, default=10, help="timed calls after one warm-up; the best is shown")

# The dims each policy size is measured at: latents of 1024^2 images (128x128 latent; Flux
# unpacked), text tokens (text_len, text_dim), pooled embedding.
POLICY_DIMS = {
    "sd35m": dict(
        latent_channels=16, text_dim=4096, pooled_dim=2048, latent_size=128, text_len=333
    ),
    "sdxl": dict(latent_channels=4, text_dim=2048, pooled_dim=1280, latent_size=128, text_len=77),
    "flux-dev": dict(
        latent_channels=16, text_dim=4096, pooled_dim=768, latent_size=128, text_len=512
    ),
    "digits": dict(latent_channels=1, text_dim=32, pooled_dim=32, latent_size=8, text_len=4),
}


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


def count_flops(module, *args, **kwargs):
    """FLOPs of one forward call (matmul, conv, attention; norms and activations not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        module(*args, **kwargs)
    return counter.get_total_flops()


def bench_policy():
    from diffusers import SD3Transformer2DModel

    # stabilityai/stable-diffusion-3.5-medium, transformer/config.json; one step at 1024^2 with CFG:
    # batch 2 (cond + uncond), 333 text tokens
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        )
        step_flops = count_flops(
            transformer,
            torch.empty(2, 16, 128, 128),
            encoder_hidden_states=torch.empty(2, 333, 4096),
            pooled_projections=torch.empty(2, 2048),
            timestep=torch.empty(2),
            return_dict=False,
        )
    backbone_params = sum(p.numel() for p in transformer.parameters())
    print(
        f"SD3.5-Medium transformer: {backbone_params / 1e9:.3f}B parameters, "
        f"{step_flops / 1e12:.2f} TFLOP per step (1024^2, CFG)"
    )
    for name, dims in POLICY_DIMS.items():
        with torch.device("meta"):
            policy = make_policy(
                POLICIES["instance"], dims, 20, network=backbones.BACKBONES[name]["policy"]
            )
            params = sum(p.numel() for p in policy.parameters())
        print(
            f"  policy for {name:9s} at L=20: {params / 1e6:7.3f}M parameters "
            f"({params / backbone_params:.2%} of SD3.5-Medium)"
        )
    dims = POLICY_DIMS["sd35m"]
    with torch.device("meta"):
        prompt = (
            torch.empty(1, dims["text_len"], 4096),
            torch.ones(1, dims["text_len"], dtype=torch.bool),
            torch.empty(1, 2048),
        )
    for steps in (5, 10, 20):
        with torch.device("meta"):  # the policy runs once per image, without CFG
            policy = make_policy(POLICIES["instance"], dims, steps, network="real")
            flops = count_flops(policy, torch.empty(1, 16, 128, 128), *prompt)
            # TPDM's runs after every step, on the state and the prediction, with t_l and l
            stepwise = make_policy(POLICIES["stepwise"], dims, steps, network="real")
            state = torch.empty(1, 32, 128, 128)
            step_policy = count_flops(stepwise, state, *prompt, torch.empty(1), 0)
        print(
            f"L={steps:2d}: sd35m policy {flops / 1e9:.2f} GFLOP once per image; "
            f"policy / (L x step) = {flops / (steps * step_flops):.4%}; step-wise policy "
            f"{step_policy / 1e9:.2f} GFLOP at each step, {steps * step_policy / flops:.1f}x the "
            f"single pass per image, policy / step = {step_policy / step_flops:.4%}"
        )


def stock_pipeline(backbone, cond, noise, steps, output_type="latent"):
    """The pipeline's own call on the same prompt embeddings, initial latents and steps as
    `Backbone.sample` (output_type "latent": the loop alone, no decode; "pt": decoded)."""
    embeddings = {key: value for key, value in cond.items() if key.endswith("prompt_embeds")}

    def call():
        return backbone.pipe(
            **embeddings,
            num_inference_steps=steps,
            guidance_scale=backbone.guidance or 0.0,
            height=backbone.resolution,
            width=backbone.resolution,
            latents=noise.to(backbone.dtype).clone(),
            output_type=output_type,
        ).images

    return call


def bench_loop(name, args, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if name.endswith("-tiny"):
        family = {"sd3-tiny": "sd3", "flux-tiny": "flux-dev", "sdxl-tiny": "sdxl"}[name]
        pipe = tiny_pipeline(family).to(device, dtype)
        backbone = backbones.from_pipeline(
            pipe, resolution=TINY_RESOLUTION, guidance=TINY_GUIDANCE[family]
        )
    else:
        backbone = backbones.load_backbone(name, path=args.model_path, device=device)
    count, steps = args.batch, args.steps
    prompts = [f"a photograph of object number {i} on a table" for i in range(count)]
    (encode_ms,), (cond,) = timed([lambda: backbone.encode_prompts(prompts)], 1, device)
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(0))
    times = backbone.default_times(steps).expand(count, -1)
    pipeline = stock_pipeline(backbone, cond, noise, steps)
    (loop_ms, pipe_ms), (ours, theirs) = timed(
        [lambda: backbone.sample(noise, cond, times), pipeline], args.repeats, device
    )
    difference = ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()
    print(
        f"{name:<10s} L={steps} batch={count} {backbone.resolution}px "
        f"{str(backbone.dtype):>14s}: loop {loop_ms:8.1f} ms, pipeline {pipe_ms:8.1f} ms "
        f"(loop/pipeline {loop_ms / pipe_ms:.2f}), encode {encode_ms:.1f} ms, "
        f"max relative difference {difference:.1e}"
    )


def bench_embedded(args, device, count=64):
    backbone = backbones.load_backbone("digits", device=device)
    cond = backbone.encode_prompts([backbone.prompts[i % 10] for i in range(count)])
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(0))
    for steps in sorted({args.steps, 10}):
        times = backbone.default_times(steps).expand(count, -1)
        (milliseconds,), _ = timed(
            [lambda: backbone.sample(noise, cond, times)], args.repeats, device
        )
        per_second = 1e3 * count / milliseconds
        print(
            f"digits L={steps:<3d} {count} rollouts: {milliseconds:8.2f} ms "
            f"({per_second:,.0f} rollouts/s)"
        )
    (milliseconds,), _ = timed([lambda: backbone.reference(noise, cond)], 1, device)
    print(
        f"digits teacher (RK4, {backbone.reference_steps} steps) for {count} contexts: "
        f"{milliseconds:8.1f} ms"
    )


def bench_inference(name, args, device, count=16):
    """Wall time of sampling `count` images at L = args.steps: the model calls alone, with the
    single-pass policy, with the step-wise one (each at its mean schedule)."""
    backbone = backbones.load_backbone(name, path=args.model_path, device=device)
    steps, preset = args.steps, backbones.BACKBONES[name]["policy"]
    prompts = backbone.prompts or [f"a hand-drawn {i % 10}" for i in range(count)]
    cond = backbone.encode_prompts([prompts[i % len(prompts)] for i in range(count)])
    noise = backbone.sample_noise(count, torch.Generator().manual_seed(0))
    times = backbone.default_times(steps).to(device).expand(count, -1)
    methods = {
        kind: policy_schedule(
            make_policy(POLICIES[kind], backbone.policy_dims, steps, times[0], preset).to(device),
            backbone,
        )
        for kind in ("instance", "stepwise")
    }
    (model, single, stepwise), _ = timed(
        [
            lambda: backbone.sample(noise, cond, times),
            lambda: run_method(backbone, methods["instance"], noise, cond),
            lambda: run_method(backbone, methods["stepwise"], noise, cond),
        ],
        args.repeats,
        device,
    )
    print(
        f"{name} L={steps}, {count} images: model calls alone {model:.1f} ms; single-pass "
        f"{single:.1f} ms (policy {1 - model / single:.1%}); step-wise {stepwise:.1f} ms (policy "
        f"{1 - model / stepwise:.1%}); step-wise / single-pass {stepwise / single:.2f}"
    )


def bench_iteration(name, iterations=12):
    """Median seconds per training iteration (metrics.jsonl's step_s, the first two left out) of
    each training on one backbone, run one after the other in this process's machine state."""

    from evidence.ablation import MINI_TRAININGS  # global, instance, stepwise, stepwise + PPO

    seconds = {}
    for training, flags in MINI_TRAININGS.items():
        with tempfile.TemporaryDirectory() as folder:
            command = [sys.executable, "train.py", "--backbone", name, "--out-dir", folder]
            command += ["--iterations", str(iterations), "--eval-contexts", "1", *flags]
            subprocess.run(command, check=True, capture_output=True, cwd=REPOSITORY)
            with open(os.path.join(folder, "metrics.jsonl")) as file:
                rows = [json.loads(line)["step_s"] for line in file][2:]
        seconds[training] = statistics.median(rows)
    print(
        f"{name}: s / iteration "
        + ", ".join(f"{t} {s:.3f} ({s / seconds['instance']:.2f}x)" for t, s in seconds.items())
    )


def bench_threads(busy_iterations=20):
    """The main job at 1 thread and at torch's default, on this machine as it is, then the first
    `busy_iterations` of it with another process keeping every core busy (a machine shared with
    other jobs): seconds per iteration from metrics.jsonl."""

    settings = (1, torch.get_num_threads())

    def train(threads, folder, *args):
        started, quiet = (
            time.perf_counter(),
            dict(stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
        )
        command = [
            sys.executable,
            "train.py",
            "--threads",
            str(threads),
            "--out-dir",
            folder,
            *args,
        ]
        subprocess.run(command, check=True, cwd=REPOSITORY, **quiet)
        with open(os.path.join(folder, "metrics.jsonl")) as file:
            rows = [json.loads(line) for line in file]
        return time.perf_counter() - started, sum(row["step_s"] for row in rows) / len(rows)

    results = {}
    for threads in settings:
        with tempfile.TemporaryDirectory() as folder:
            seconds, per_iteration = train(threads, folder)
            with open(os.path.join(folder, "eval.json")) as file:
                results[threads] = {row["method"]: row["mean"] for row in json.load(file)["rows"]}
        print(
            f"python train.py --threads {threads}: {seconds:.1f} s "
            f"({per_iteration:.3f} s per iteration), "
            f"held-out learned (mean) {results[threads]['learned (mean)']:.6f}"
        )
    one, default = results.values()
    largest = max(abs(one[name] - default[name]) for name in one)
    print(f"largest difference of a held-out mean between the two: {largest:.2e}")
    busy = "import torch\nx = torch.randn(1024, 1024)\nwhile True: x = (x @ x).tanh()"
    hog = subprocess.Popen([sys.executable, "-c", busy])
    try:
        for threads in settings:
            with tempfile.TemporaryDirectory() as folder:
                _, per_iteration = train(
                    threads, folder, "--iterations", str(busy_iterations), "--eval-contexts", "8"
                )
            print(
                f"every core busy with another process: --threads {threads}: "
                f"{per_iteration:.3f} s per iteration (first {busy_iterations} iterations)"
            )
    finally:
        hog.kill()


def bench_ocr(batch=4):
    from PIL import Image, ImageDraw, ImageFont

    class Images:  # a stand-in backbone whose latents are the images
        device = torch.device("cpu")

        def decode(self, latents):
            return latents

    reward = load_reward("ocr", Images())
    for size in (512, 1024):
        canvas = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(canvas).text(
            (size / 2, size / 2),
            "OPEN LATE",
            "black",
            ImageFont.load_default(size=size // 8),
            anchor="mm",
        )
        images = (
            torch.tensor(list(canvas.getdata()), dtype=torch.float32)
            .view(size, size, 3)
            .permute(2, 0, 1)
            .div(255)
            .expand(batch, -1, -1, -1)
        )
        prompts = ['a neon sign that says "OPEN LATE"'] * batch
        (milliseconds,), (scores,) = timed(
            [lambda: reward(images, prompts, None, None)], 1, torch.device("cpu")
        )
        print(
            f"ocr {size}x{size}, {batch} per call, {torch.get_num_threads()} threads: "
            f"{milliseconds / batch / 1e3:.2f} s per image, recall {scores.tolist()}"
        )


# -----------------------------------------------------------------------------
# at the floor: each path against the model calls it cannot avoid, measured in this one process


def quietly(function, *args):
    """function(*args) with its printing (progress bars, tables) kept off the report."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return function(*args)


def bench_training_floor(name, iterations=14):
    """A training iteration against its floor: train.py's median step_s (its first two and its last,
    which also checkpoints, left out), against the model calls of one iteration timed alone on the
    same sizes: the backbone sampling the B x K rollouts (L calls each) and the reward scoring them,
    with fresh contexts every time (the teacher solves each new context once, as in training)."""
    import train

    with tempfile.TemporaryDirectory() as folder:
        config = quietly(train.parse_config, ["--backbone", name, "--out-dir", folder])
        config.iterations, config.eval_contexts = iterations, 8
        torch.set_num_threads(config.threads or torch.get_num_threads())
        quietly(train.main, config)
        with open(os.path.join(folder, "metrics.jsonl")) as file:
            steps = [json.loads(line)["step_s"] for line in file][2:-1]
    backbone = backbones.load_backbone(name)
    reward = load_reward(config.reward, backbone)
    prompts = backbone.prompts or load_prompt_file(config.prompts)
    count, seeds = config.contexts * config.rollouts, iter(range(10**7, 10**8))
    times = backbone.default_times(config.steps).expand(count, -1)

    floor = []
    for _ in range(len(steps)):
        contexts = [next(seeds) for _ in range(config.contexts)]
        noise = context_noise(backbone, contexts).repeat_interleave(config.rollouts, 0)
        batch = [prompts[seed % len(prompts)] for seed in contexts for _ in range(config.rollouts)]
        cond = backbone.encode_prompts(batch)  # training encodes its few prompts once
        started = time.perf_counter()
        with torch.no_grad():
            reward(backbone.sample(noise, cond, times), batch, noise, cond)
        floor.append(time.perf_counter() - started)
    iteration, calls = statistics.median(steps), statistics.median(floor)
    print(
        f"{name} training iteration (B={config.contexts}, K={config.rollouts}, L={config.steps}, "
        f"{config.reward}): {iteration:.3f} s against its model calls {calls:.3f} s: "
        f"{iteration / calls:.2f}x"
    )


def bench_generate(name="mini-sd3", count=8, steps=3, repeats=5):
    """backbones.pipeline.generate (the policy, then every image in one batch) against the stock
    pipeline's own call on the same prompts at its default schedule, both decoded to PIL images."""
    from backbones.pipeline import generate

    backbone = backbones.load_backbone(name)
    pipe = backbone.pipe
    prompts = load_prompt_file(backbones.BACKBONES[name]["prompts"][1])[:count]
    policy = make_policy(POLICIES["instance"], backbone.policy_dims, steps, backbone=name)
    side = backbone.resolution

    def learned():
        return generate(pipe, policy, prompts, generator=torch.Generator().manual_seed(0))

    def stock():
        return pipe(
            prompts,
            num_inference_steps=steps,
            height=side,
            width=side,
            guidance_scale=backbone.guidance,
            generator=torch.Generator().manual_seed(0),
        )

    (ours, theirs), _ = timed([learned, stock], repeats, torch.device("cpu"))
    print(
        f"{name} generate, {count} prompts, L={steps}: {ours:.1f} ms against the stock "
        f"{type(pipe).__name__} {theirs:.1f} ms: {ours / theirs:.2f}x"
    )


def bench_evaluate(name="mini-sd3", count=256):
    """evaluate.py on a run of `name` (its default and learned rows on `count` held-out contexts,
    the run's reward, its table and scores), in this process, against those rows' model
    calls timed alone: the backbone sampling each batch and the reward scoring it."""
    import evaluate
    import train

    with tempfile.TemporaryDirectory() as folder:
        run = os.path.join(folder, "run")
        config = quietly(train.parse_config, ["--backbone", name, "--out-dir", run])
        config.iterations, config.eval_contexts = 1, 4
        quietly(train.main, config)
        ckpt = os.path.join(run, "ckpt.pt")
        arguments = ["--ckpt", ckpt, "--count", str(count), "--out-dir", f"{folder}/eval"]
        started = time.perf_counter()
        quietly(evaluate.main, arguments)
        total = time.perf_counter() - started
        policy, _ = load_policy(ckpt)
    backbone = backbones.load_backbone(name)
    reward = load_reward(config.reward, backbone)
    prompts, seeds = heldout_contexts(load_prompt_file(config.eval_prompts), count)
    methods = [default_schedule(backbone, config.steps), policy_schedule(policy, backbone)]
    batch, calls = 8 if backbone.resolution >= 512 else 256, 0.0
    for start in range(0, count, batch):
        noise = context_noise(backbone, seeds[start : start + batch])
        cond = backbone.encode_prompts(prompts[start : start + batch])
        times = [method(noise, cond) for method in methods]  # the policy's call is not a model's
        started = time.perf_counter()
        with torch.no_grad():
            for used in times:
                latents = backbone.sample(noise, cond, used)
                reward.details(latents, prompts[start : start + batch])
        calls += time.perf_counter() - started
    print(
        f"evaluate.py on a {name} run, {count} contexts x 2 rows: {total:.1f} s against their "
        f"model calls {calls:.1f} s: {total / calls:.2f}x"
    )


def bench_main_job():
    """`python train.py`, the main job, in a process of its own as a user runs it: its wall time,
    and how it splits into start-up (to the end of the first iteration, less that iteration), the
    iterations (metrics.jsonl's step_s) and the finish (held-out report, policy)."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "metrics.jsonl")
        started = time.perf_counter()
        command, quiet = [sys.executable, "train.py", "--out-dir", folder], subprocess.DEVNULL
        process = subprocess.Popen(command, cwd=REPOSITORY, stdout=quiet, stderr=quiet)
        first = None
        while process.poll() is None:
            if first is None and os.path.isfile(metrics) and os.path.getsize(metrics):
                first = time.perf_counter() - started
            time.sleep(0.02)
        total = time.perf_counter() - started
        if process.returncode:
            raise RuntimeError(f"python train.py failed ({process.returncode})")
        with open(metrics) as file:
            steps = [json.loads(line)["step_s"] for line in file]
    start_up = first - steps[0]
    finish = total - start_up - sum(steps)
    print(
        f"main job, python train.py ({len(steps)} iterations): {total:.1f} s: start-up "
        f"{start_up:.1f} s, iterations {sum(steps):.1f} s, finish {finish:.1f} s; start-up / "
        f"iterations {start_up / sum(steps):.2f}"
    )


# -----------------------------------------------------------------------------
# gpu: the real backbones' sizes at random weights, trained through train.py's own main

# Each component as its model's published config.json gives it (the denoiser, the VAE, the text
# encoders, the scheduler); the tokenizers are miniatures/layouts.py's, built offline (a token
# per character), whose ids every real vocabulary holds: CLIP's start and end tokens are theirs.
CLIP = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=512, eos_token_id=513)
CLIP_L = dict(  # openai/clip-vit-large-patch14's text tower
    CLIP, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    projection_dim=768, hidden_act="quick_gelu",
)  # fmt: skip
CLIP_G = dict(  # OpenCLIP ViT-bigG/14's text tower
    CLIP, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    projection_dim=1280, hidden_act="gelu",
)  # fmt: skip
T5_XXL = dict(  # google/t5-v1_1-xxl's encoder
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False,
)  # fmt: skip
VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
FLOW_VAE = dict(VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
SD3_VAE = dict(FLOW_VAE, scaling_factor=1.5305, shift_factor=0.0609)
MMDIT = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
    joint_attention_dim=4096, pooled_projection_dim=2048, qk_norm="rms_norm",
)  # fmt: skip
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280), attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048, use_linear_projection=True,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,  # 6 time ids x 256 + CLIP-G's 1280
)  # fmt: skip
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
GPU_MODELS = {  # backbone -> its denoiser's and VAE's configurations
    "sd35m": dict(
        denoiser=dict(MMDIT, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                      pos_embed_max_size=384, dual_attention_layers=tuple(range(13))),
        vae=SD3_VAE,
    ),
    "sd35l": dict(
        denoiser=dict(MMDIT, num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                      pos_embed_max_size=192),
        vae=SD3_VAE,
    ),
    "sdxl": dict(denoiser=SDXL_UNET, vae=dict(VAE, latent_channels=4, scaling_factor=0.13025)),
    "flux-dev": dict(
        denoiser=FLUX_DEV, vae=dict(FLOW_VAE, scaling_factor=0.3611, shift_factor=0.1159)
    ),
}  # fmt: skip
# per family: the denoiser (its name here, its class), the text encoders (name, class,
# configuration) in the pipeline's order, the scheduler (class, its scheduler_config.json)
FAMILY_PARTS = {
    "sd3": dict(
        denoiser=("MMDiT", "SD3Transformer2DModel"),
        text=[("CLIP-L", "CLIPTextModelWithProjection", CLIP_L),
              ("CLIP-G", "CLIPTextModelWithProjection", CLIP_G),
              ("T5-XXL", "T5EncoderModel", T5_XXL)],
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(shift=3.0)),
    ),
    "sdxl": dict(
        denoiser=("UNet", "UNet2DConditionModel"),
        text=[("CLIP-L", "CLIPTextModel", CLIP_L),
              ("CLIP-G", "CLIPTextModelWithProjection", CLIP_G)],
        scheduler=("EulerDiscreteScheduler", dict(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
            timestep_spacing="leading")),
    ),
    "flux": dict(
        denoiser=("Flux transformer", "FluxTransformer2DModel"),
        text=[("CLIP-L", "CLIPTextModel", CLIP_L), ("T5-XXL", "T5EncoderModel", T5_XXL)],
        scheduler=("FlowMatchEulerDiscreteScheduler", dict(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)),
    ),
}  # fmt: skip
# --tiny: the same layouts at a CPU test's size (what is not named keeps its real value); the
# widths that join components stay consistent (SD3: T5's d_model is the joint dim, the two CLIP
# projections the pooled one; SD-XL: the two CLIP widths the cross-attention dim)
TINY_SIZES = dict(
    clip=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              projection_dim=16),
    t5=dict(d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    vae=dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4),
    sd3=dict(num_layers=1, num_attention_heads=2, attention_head_dim=8, caption_projection_dim=16,
             joint_attention_dim=32, pooled_projection_dim=32, pos_embed_max_size=16,
             dual_attention_layers=(0,)),
    sdxl=dict(block_out_channels=(8, 16, 32), attention_head_dim=(1, 2, 4), layers_per_block=1,
              transformer_layers_per_block=(1, 1, 1), norm_num_groups=4, cross_attention_dim=32,
              addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 16),
    flux=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 4, 8)),
)  # fmt: skip
# --tiny's HPS model: open_clip's CLIP at 224 px with the real vocabulary and context (hpsv2's
# tokenizer applies), narrow and shallow
TINY_HPS = dict(
    embed_dim=16,
    vision_cfg=dict(image_size=224, layers=2, width=32, head_width=16, patch_size=32),
    text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2),
)
# of the presets' 16 or 32 contexts and 1000 iterations: the first warms up, the last checkpoints,
# the ones between are timed, and the stock pipeline as often
GPU_CONTEXTS, GPU_ITERATIONS = 8, 6


def gpu_pipeline(name, device, dtype, tiny=False):
    """The diffusers pipeline of backbone `name` at random weights, built directly on `device` in
    `dtype` (on the meta device: the shapes alone, no memory); tiny: at TINY_SIZES."""
    import diffusers
    import transformers

    family = backbones.BACKBONES[name]["family"]
    parts, sizes = FAMILY_PARTS[family], TINY_SIZES if tiny else {}
    denoiser = GPU_MODELS[name]["denoiser"] | sizes.get(family, {})
    vae = GPU_MODELS[name]["vae"] | sizes.get("vae", {})
    stages = len(vae["block_out_channels"])
    vae |= dict(down_block_types=("DownEncoderBlock2D",) * stages)
    vae |= dict(up_block_types=("UpDecoderBlock2D",) * stages)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # every weight created in dtype, on the device
    try:
        with torch.device(device):
            torch.manual_seed(0)
            components = dict(
                transformer=getattr(diffusers, parts["denoiser"][1])(**denoiser),
                vae=diffusers.AutoencoderKL(**vae),
            )
            for index, (_, kind, config) in enumerate(parts["text"]):
                size = sizes.get("t5" if kind == "T5EncoderModel" else "clip", {})
                encoder = getattr(transformers, kind)
                model = encoder(encoder.config_class(**config | size))
                components["text_encoder" + (f"_{index + 1}" if index else "")] = model
    finally:
        torch.set_default_dtype(previous)
    if family == "sdxl":
        components["unet"] = components.pop("transformer")
        components["add_watermarker"] = False
    # the tokenizers of the tiny pipelines, and the real scheduler (built on the CPU, as loaded)
    text = tiny_text({"sd3": "sd3", "flux": "flux-dev", "sdxl": "sdxl"}[family])
    components |= {key: value for key, value in text.items() if key.startswith("tokenizer")}
    scheduler, options = parts["scheduler"]
    components["scheduler"] = getattr(diffusers, scheduler)(**options)
    pipeline = getattr(diffusers, backbones.FAMILIES[family].pipeline)(**components)
    return pipeline if torch.device(device).type == "meta" else pipeline.to(device, dtype)


def in_units(counts):
    """'MMDiT 2.470B, VAE 83.8M, ...' of parameter_counts."""
    return ", ".join(
        f"{key} {n / 1e9:.3f}B" if n >= 1e9 else f"{key} {n / 1e6:.3g}M"
        for key, n in counts.items()
    )


def parameter_counts(name, pipe):
    """Component -> its weights as a checkpoint holds them (parameters and saved buffers such as
    SD3's position table; a shared tensor once)."""
    parts = FAMILY_PARTS[backbones.BACKBONES[name]["family"]]
    modules = {parts["denoiser"][0]: getattr(pipe, "unet", None) or pipe.transformer}
    modules["VAE"] = pipe.vae
    for index, (component, _, _) in enumerate(parts["text"]):
        modules[component] = getattr(pipe, "text_encoder" + (f"_{index + 1}" if index else ""))
    return {
        component: sum(
            {id(t): t.numel() for t in module.state_dict(keep_vars=True).values()}.values()
        )
        for component, module in modules.items()
    }


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:  # Linux: 5 resets the process's peak resident set (VmHWM)
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")


def peak_memory(device):
    """GiB since reset_peak: the device's peak allocated memory; on a CPU, the process's peak
    resident memory (Python and its libraries included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/status") as file:
        kib = next(int(line.split()[1]) for line in file if line.startswith("VmHWM:"))
    return kib / 2**20


class ContrastReward:
    """A reward with no weights, for machines without hpsv2: 100 x the decoded images' pixel
    standard deviation. It decodes as the image rewards do, so the VAE's cost stays in the loop."""

    def __init__(self, device):
        self.device, self.backbone = device, None

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        return 100 * self.backbone.decode(latents).flatten(1).std(1).to(self.device)


def gpu_reward(device, folder, tiny):
    """(reward, what it is): HPSv2's ViT-H-14 at random weights (tiny: TINY_HPS), saved in `folder`
    as an HPS checkpoint and loaded by rewards/hps.py as the real one is; without hpsv2,
    ContrastReward. bench_gpu sets its backbone."""
    import importlib.util

    if importlib.util.find_spec("hpsv2") is None:
        return ContrastReward(device), "pixel contrast (no weights; hpsv2 is not installed)"
    from hpsv2.src import open_clip

    model_name = "ViT-H-14"
    if tiny:
        model_name, path = "hps-bench-tiny", os.path.join(folder, "hps-bench-tiny.json")
        with open(path, "w") as file:
            json.dump(TINY_HPS, file)
        open_clip.add_model_config(path)
    torch.manual_seed(0)
    model = open_clip.create_model(model_name, pretrained=None, output_dict=True)
    checkpoint = os.path.join(folder, "HPS_v2.1_compressed.pt")
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    del model
    reward = load_reward("hpsv2", None, device, checkpoint, model_name=model_name)
    return reward, f"HPSv2 ({model_name}, random weights)"


def bench_gpu(name, device, dtype, reward, tiny):
    """train.py's main on backbone `name` built at random weights, at its preset (B = GPU_CONTEXTS
    contexts): seconds per iteration, peak memory of the load, the loop and the held-out report,
    the largest batch the frozen model saw, and an iteration's time per image against the stock
    pipeline's for as many images (its rollout batch, L steps, decoded)."""
    import train

    spec, preset = backbones.BACKBONES[name], train.PRESETS[name]
    resolution = TINY_RESOLUTION if tiny else spec["resolution"]
    reset_peak(device)  # the load's peak: the pipeline built, then train.py's setup
    pipe = gpu_pipeline(name, device, dtype, tiny)
    sizes = in_units(parameter_counts(name, pipe))  # before train.py drops the text encoders
    backbone = backbones.from_pipeline(pipe, name, resolution, spec["guidance"])
    reward.backbone = backbone
    batch = preset["rollout_batch"]
    per_call = batch * (2 if backbone.cfg else 1)  # [uncond; cond] under CFG
    phase, largest, peaks = ["setup"], {}, {}

    def count(module, args, kwargs):  # the batch of each model call, by phase
        states = args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))
        largest[phase[0]] = max(largest.get(phase[0], 0), states.shape[0])

    def on_checkpoint(policy, iteration):  # at the loop's start (0) and end
        peaks["load" if iteration == 0 else "loop"] = peak_memory(device)
        phase[0] = "loop" if iteration == 0 else "report"
        reset_peak(device)

    hook = backbone.model.register_forward_pre_hook(count, with_kwargs=True)
    with tempfile.TemporaryDirectory() as folder:
        arguments = ["--backbone", name, "--out-dir", folder, "--device", device.type]
        arguments += ["--contexts", str(GPU_CONTEXTS), "--iterations", str(GPU_ITERATIONS)]
        arguments += ["--ckpt-interval", str(GPU_ITERATIONS)]  # one checkpoint: the loop's end
        # as many held-out contexts as the rollout batch: the report's calls are full ones
        arguments += ["--eval-contexts", str(batch), *(["--threads", "1"] if tiny else [])]
        config = quietly(train.parse_config, arguments)
        quietly(lambda: train.main(config, on_checkpoint=on_checkpoint, loaded=(backbone, reward)))
        peaks["report"] = peak_memory(device)
        with open(os.path.join(folder, "metrics.jsonl")) as file:
            seconds = [json.loads(line)["step_s"] for line in file]
    hook.remove()
    # the stock pipeline on a rollout batch of training prompts, as encoded for the loop
    prompts = load_prompt_file(config.prompts)[:batch]
    cond = backbone.encode_prompts(prompts)
    noise = context_noise(backbone, range(batch))
    stock = stock_pipeline(backbone, cond, noise, config.steps, "pt")  # decoded, as rewards do
    (pipe_ms,), _ = timed([stock], GPU_ITERATIONS - 2, device)
    reward.backbone = None  # the next family's pipeline is built without this one
    loop_image = min(seconds[1:-1]) / (config.contexts * config.rollouts)
    pipe_image = pipe_ms / 1e3 / batch
    memory = "allocated" if device.type == "cuda" else "process resident"
    print(
        f"{name}: {sizes}; {resolution}px {str(backbone.dtype).removeprefix('torch.')}, "
        f"B={config.contexts} K={config.rollouts} L={config.steps}, --rollout-batch {batch} "
        f"({per_call} per model call{' under CFG' if backbone.cfg else ''})\n"
        f"  s / iteration: {', '.join(f'{s:.3f}' for s in seconds)} (the first warms up, the last "
        "checkpoints)\n"
        f"  peak memory ({memory}): load {peaks['load']:.2f} GiB (with train.py's setup), loop "
        f"{peaks['loop']:.2f} GiB, held-out report {peaks['report']:.2f} GiB\n"
        f"  largest model batch: loop {largest['loop']}, held-out report {largest['report']}\n"
        f"  time per image: loop {loop_image:.4f} s (the best iteration between), stock "
        f"{type(pipe).__name__} {pipe_image:.4f} s (batch {batch}, L={config.steps}, decoded): "
        f"loop / pipeline {loop_image / pipe_image:.2f}"
    )


def run_gpu(args, device):
    """bench_gpu on each backbone named, after the real configurations' sizes (meta device)."""
    import diffusers
    import transformers

    names = (args.backbones or ",".join(GPU_MODELS)).split(",")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # a token per character: most prompts pass CLIP's 77 tokens, which both libraries note per call
    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"diffusers {diffusers.__version__}, transformers {transformers.__version__} on {where}"
        + (f"; tiny pipelines at {TINY_RESOLUTION}px" if args.tiny else "")
    )
    print("real configurations, weights per component (meta device):")
    for name in names:
        print(f"  {name}: {in_units(parameter_counts(name, gpu_pipeline(name, 'meta', dtype)))}")
    # tiny: the real policy's 20M parameters would outweigh a tiny pipeline on a CPU
    smaller = dict(real=NETWORKS["embedded"]) if args.tiny else {}
    with tempfile.TemporaryDirectory() as folder, mock.patch.dict(NETWORKS, smaller):
        reward, described = gpu_reward(device, folder, args.tiny)
        print(f"reward: {described}")
        for name in names:
            bench_gpu(name, device, dtype, reward, args.tiny)
            if device.type == "cuda":  # the next family starts from an empty device
                gc.collect()
                torch.cuda.empty_cache()


def run(args, device):
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} CPU threads")
    if args.gpu:
        return run_gpu(args, device)
    if args.only in (None, "policy"):
        bench_policy()
    if args.only in (None, "loop"):
        for name in (args.backbones or "sd3-tiny,flux-tiny,sdxl-tiny").split(","):
            bench_loop(name, args, device)
    if args.only in (None, "embedded"):
        bench_embedded(args, device)
    if args.only in (None, "floor"):
        for name in ("digits", "mini-sd3"):
            bench_training_floor(name)
        bench_generate()
        bench_evaluate()
        bench_main_job()
    if args.only == "threads":
        bench_threads()
    if args.only == "ocr":
        bench_ocr()
    if args.only == "iteration":
        for name in (args.backbones or "digits-prompt,mini-sd3").split(","):
            bench_iteration(name)
    if args.only == "inference":
        for name in (args.backbones or "digits,mini-sd3").split(","):
            bench_inference(name, args, device)


class Tee(io.StringIO):
    """What is printed, also kept: the benchmark's report goes to docs/RESULTS.md as printed."""

    def write(self, text):
        sys.__stdout__.write(text)
        return super().write(text)


if __name__ == "__main__":
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    if args.tiny and not args.gpu:
        parser.error("--tiny goes with --gpu")
    if args.gpu and not args.tiny and device.type != "cuda":
        parser.error("--gpu needs a CUDA device (--gpu --tiny runs its code on the CPU)")
    started, printed = commit(), Tee()  # commit() is "unknown" without git
    with contextlib.redirect_stdout(printed):
        run(args, device)
    if args.tiny:  # a check of the code, not a measurement
        sys.exit()
    command = " ".join(["python -m evidence.bench", *sys.argv[1:]])
    record(
        f"bench {'gpu' if args.gpu else args.only or 'all'} on {device.type}",
        command,
        ["```", *printed.getvalue().splitlines(), "```"],
        at=started,
    )
