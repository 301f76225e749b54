"""
PPO as TPDM's trainer takes it (github.com/maple-research-lab/TPDM, src/train/rloo_trainer.py on
TRL 0.11's RLOO trainer), the update of `train.py --optimizer ppo`, and the settings of TPDM's own
code, which that flag makes the defaults (TPDM below; README names each file).
"""

import torch

# The defaults that --optimizer ppo sets (train.resolve): RLOO advantages over the K rollouts, not
# normalised (src/train/rloo_trainer.py); Adam(0.9, 0.99), eps 1e-5, no weight decay, a constant
# rate (scripts/launch_sd3_train.sh; AdamW with weight decay 0 is Adam); head bias (2.5, 1.0), the
# hidden states as inputs and the Beta's mode at inference
# (src/models/stable_diffusion_3/modeling_sd3_pnt.py). init, policy_inputs and inference are the
# step-wise policy's: another policy keeps the REINFORCE defaults for them.
TPDM = dict(
    baseline="rloo",
    init="tpdm",
    policy_inputs="hidden",
    inference="mode",
    weight_decay=0.0,
    lr_decay="constant",
    adam_beta2=0.99,
    adam_eps=1e-5,
)
STEPWISE_ONLY = ("init", "policy_inputs", "inference")
# PPO takes ppo_epochs x ppo_minibatches Adam steps per batch. TPDM's lr (1e-6 for SD3's 2-conv
# head) does not transfer to this network and budget; the backbone's REINFORCE rate times this
# factor is the default, not tuned for TPDM's settings: evidence/comparator_study.py tunes --lr on
# training contexts (docs/COMPARATOR.md)
LR_FACTOR = 1 / 30


def ppo_objective(logp, logp_old, advantages, clip):
    """PPO's clipped surrogate loss (Schulman et al. 2017), to minimise, and the fraction of
    samples whose ratio was clipped:
        -mean(min(rho A, clip(rho, 1 - eps, 1 + eps) A)),   rho = exp(log pi - log pi_old)
    one ratio per schedule (the whole trajectory's log-probability; its only reward is the final
    image's)."""
    ratio = (logp - logp_old.detach()).exp()
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    return loss, (clipped != ratio).float().mean().detach()


def ppo_update(config, log_probs, logp_old, advantages, step, shuffle):
    """PPO's update on one batch of rollouts, as TPDM's trainer takes it: config.ppo_epochs passes,
    each over a fresh shuffle (generator `shuffle`) cut into config.ppo_minibatches, one step each
    on the clipped objective. log_probs(index) -> log pi of those samples with gradients; logp_old,
    advantages (N,): log pi as drawn and r - b; step(loss) takes one optimiser step and returns the
    gradient norm. Returns the last loss and gradient norm, and the fraction of ratios clipped over
    the last pass."""
    for _ in range(config.ppo_epochs):
        order = torch.randperm(len(advantages), generator=shuffle).to(advantages.device)
        clipped = []
        for index in order.chunk(config.ppo_minibatches):
            loss, fraction = ppo_objective(
                log_probs(index), logp_old[index], advantages[index], config.ppo_clip
            )
            grad_norm = step(loss)
            clipped.append(fraction * len(index))
    return loss, grad_norm, (sum(clipped) / len(advantages)).item()
