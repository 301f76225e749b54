"""A trained schedule in a stock diffusers pipeline (pipeline.py), and the policy in the Hub format."""
import json

import pytest
import torch

import pipeline
import rollout
from bench import TINY_GUIDANCE, TINY_RESOLUTION, tiny_pipeline
from checkpoints import load_checkpoint, load_policy, save_policy
from policy import make_policy, mean_increments, times_from_increments


def learned_policy(backbone, steps, seed=0, kind="instance"):
    """A policy whose schedules differ per context and end at a stop margin > 0 (the head's last layer,
    zero at initialisation, gets random weights)."""
    torch.manual_seed(seed)
    policy = make_policy(kind, backbone.policy_dims, steps, init_times=backbone.default_times(steps), stop_margin=0.02)
    with torch.no_grad():
        if kind == "instance":
            policy.head[-1].weight.normal_(0.0, 0.3)
        else:
            policy.logits.add_(0.5 * torch.randn(steps + 1))
    return policy.eval()


@pytest.fixture(scope="module", params=["sd3", "flux-dev", "sdxl", "mini-sd3", "mini-flux", "mini-sdxl"])
def tiny(request):
    """A tiny random pipeline of each family, and the trained miniatures (miniature.py) as shipped."""
    if request.param.startswith("mini-"):
        backbone = rollout.load_backbone(request.param)
        return backbone.pipe, backbone
    pipe = tiny_pipeline(request.param)
    return pipe, rollout.from_pipeline(pipe, resolution=TINY_RESOLUTION, guidance=TINY_GUIDANCE[request.param])


@pytest.mark.parametrize("steps", [1, 4, 9])
def test_generate_in_the_stock_pipeline_equals_the_sampling_loop(tiny, steps):
    pipe, backbone = tiny
    policy = learned_policy(backbone, steps)
    prompts = ["a cat", "a red house on a hill"]
    latents = pipeline.generate(pipe, policy, prompts, generator=torch.Generator().manual_seed(5), output_type="latent",
                                height=backbone.resolution, guidance_scale=backbone.guidance or 0.0).images
    noise = pipeline.pipeline_noise(backbone, 2, torch.Generator().manual_seed(5))
    cond = backbone.encode_prompts(prompts)
    with torch.no_grad():
        times = times_from_increments(mean_increments(policy(**backbone.policy_inputs(noise, cond))))
    assert (times[0] - times[1]).abs().max() > 1e-4 and (times[:, -1] > 1e-3).all()  # per-context schedules, a stop margin
    expected = backbone.sample(noise, cond, times)
    assert latents.shape == expected.shape
    # float32 rounding is relative to the largest state on the way: the output, or for SD-XL the start,
    # noise * sqrt(sigma(t_0)^2 + 1), about 15x the noise at t_0 = 1 (a trained UNet's steps are large)
    start = (backbone.sigma(times[:, :1]) ** 2 + 1).sqrt().view(-1, 1, 1, 1) if isinstance(backbone, rollout.SDXLBackbone) else 1.0
    scale = max(expected.abs().max().item(), (noise.float() * start).abs().max().item())
    assert (latents - expected).abs().max().item() / scale < 1e-5
    assert type(pipe.scheduler).__name__ in ("FlowMatchEulerDiscreteScheduler", "EulerDiscreteScheduler")  # restored


def test_the_pipeline_draws_the_same_noise_as_its_own_call(tiny):
    pipe, backbone = tiny
    seen = []
    original = pipe.transformer if hasattr(pipe, "transformer") else pipe.unet
    handle = original.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        kwargs.get("hidden_states", args[0] if args else kwargs.get("sample"))), with_kwargs=True)
    try:
        pipe("a cat", num_inference_steps=1, height=backbone.resolution, width=backbone.resolution, output_type="latent",
             generator=torch.Generator().manual_seed(3), guidance_scale=backbone.guidance or 0.0)
    finally:
        handle.remove()
    noise = pipeline.pipeline_noise(backbone, 1, torch.Generator().manual_seed(3))
    # the first model input is the noise itself (SD-XL: scaled by init_noise_sigma = sqrt(sigma_0^2 + 1), then by
    # 1 / sqrt(sigma_0^2 + 1)); the last row is the conditional half of a CFG batch
    assert torch.allclose(seen[0][-1:].float(), noise.float(), atol=1e-5)


def test_policy_folder_round_trip_without_pickle(tmp_path):
    backbone = rollout.load_backbone("digits")
    policy = learned_policy(backbone, 4)
    config = dict(backbone="digits", steps=4, seed=0)
    save_policy(tmp_path / "policy", policy, config, iteration=7)
    assert sorted(path.name for path in (tmp_path / "policy").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    saved = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert saved["backbone"] == "digits" and saved["steps"] == 4 and saved["training"] == config and saved["iteration"] == 7
    checkpoint, loaded = load_checkpoint(str(tmp_path / "policy"), backbone="digits", steps=4)
    assert checkpoint == dict(config=config, iteration=7)
    noise = backbone.sample_noise(3, torch.Generator().manual_seed(0))
    inputs = backbone.policy_inputs(noise, backbone.encode_prompts(backbone.prompts[:3]))
    with torch.no_grad():
        assert torch.equal(loaded(**inputs), policy(**inputs))
        assert torch.equal(load_policy(str(tmp_path / "policy"))(**inputs), policy(**inputs))  # the README's call
    with pytest.raises(ValueError, match="was trained for L=4 steps, not L=8") as error:
        load_checkpoint(str(tmp_path / "policy"), steps=8)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="was trained on backbone 'digits', not 'sd35m'"):
        load_checkpoint(str(tmp_path / "policy"), backbone="sd35m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no policy saved by train.py"):
        load_checkpoint(str(tmp_path / "empty"))


def test_train_writes_the_policy_folder(digits_run):
    checkpoint, policy = load_checkpoint(str(digits_run / "policy"), backbone="digits", steps=4)
    _, from_checkpoint = load_checkpoint(str(digits_run / "ckpt.pt"))
    assert checkpoint["iteration"] == 60 and checkpoint["config"]["backbone"] == "digits"
    for name, value in from_checkpoint.state_dict().items():
        assert torch.equal(policy.state_dict()[name], value), name


def test_a_global_schedule_exports_as_json(tiny):
    _, backbone = tiny
    policy = learned_policy(backbone, 3, kind="global")
    exported = json.loads(json.dumps(pipeline.schedule_json(policy, backbone)))
    times = times_from_increments(mean_increments(policy(torch.zeros(1))))[0]
    assert exported["steps"] == 3 and torch.allclose(torch.tensor(exported["times"], dtype=torch.float64), times.double(), atol=1e-7)
    assert exported["times"][0] == 1.0 and exported["times"][-1] > 0  # ends at the stop margin, no final 0
    sigmas = backbone.sigma(times) if isinstance(backbone, rollout.SDXLBackbone) else times
    assert torch.allclose(torch.tensor(exported["sigmas"]).float(), sigmas, rtol=1e-6)
    with pytest.raises(ValueError, match="only a global one exports"):
        pipeline.schedule_json(learned_policy(backbone, 3), backbone)
