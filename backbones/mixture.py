"""
The embedded backbones (digits, digits-prompt, digits-noise, digits-xor): class-conditional Gaussian
mixtures over scikit-learn's 8x8 digits with a closed-form flow, so that the best schedule of a set
of contexts can be computed (evidence/ablation.py's oracles).
"""

import functools

import torch

from prompts import shown
from rollout import Backbone

DIGIT_TOKENS = 4  # prompt tokens: "a", "handwritten", the digit, one padding token (masked out)
DIGIT_WIDTH = 32  # width of the token embeddings
DIGIT_VOCAB = ["<pad>", "a", "handwritten"] + [str(d) for d in range(10)]


class MixtureBackbone(Backbone):
    """The real models' code path (prompts -> embeddings, noise -> run_schedule -> decode) with a
    known optimum. Data: scikit-learn's 8x8 digits, pixels rescaled to [-1, 1]. For "a handwritten
    d", with y_i the images of class d and m_d their mean, each sub-population (spread k, std s,
    shift b: a number or a (64,) pattern) of `populations[d]` puts one component N(mu_i, s^2 I) at
    mu_i = m_d + k (y_i - m_d) + b for every y_i; all components of a class weigh the same.
    With x_t = (1 - t) x_0 + t noise the marginal given component m is N((1 - t) mu_m, v_m I),
    v_m = (1 - t)^2 s_m^2 + t^2, and the velocity E[noise - x_0 | x_t] is

        v(x, t) = sum_m w_m [c_m (x - (1 - t) mu_m) - mu_m],    c_m = (t - (1 - t) s_m^2) / v_m,

    with posterior weights w = softmax_m(-|x - (1 - t) mu_m|^2 / (2 v_m) - (d/2) log v_m), d = 64.
    """

    # the teacher's RK4 solve (reference); a BACKBONES row may set them (teacher=)
    reference_steps, reference_power, reference_dtype = 64, 1.0, torch.float64

    def __init__(self, name, populations, device=None, teacher=None):
        from sklearn.datasets import load_digits  # the data ships inside scikit-learn, no download

        if teacher is not None:
            self.reference_steps, self.reference_power = teacher["steps"], teacher["power"]
            self.reference_dtype = getattr(torch, teacher["dtype"])

        digits = load_digits()
        self.name, self.device, self.dtype = name, torch.device(device or "cpu"), torch.float32
        self.resolution, self.guidance, self.latent_shape = 8, None, (1, 8, 8)
        self.prompts = [f"a handwritten {d}" for d in range(10)]
        self.policy_dims = dict(latent_channels=1, text_dim=DIGIT_WIDTH, pooled_dim=DIGIT_WIDTH)
        pixels = torch.tensor(digits.images.reshape(-1, 64), dtype=torch.float64) / 8.0 - 1.0
        labels = torch.tensor(digits.target)
        centres, variances = [], []  # per class: (M_d, 64) and s_m^2 (M_d,)
        for digit in range(10):
            members = pixels[labels == digit]
            mean, groups = members.mean(0), populations[digit]
            centres.append(torch.cat([mean + k * (members - mean) + b for k, _, b in groups]))
            stds = torch.cat([torch.full((len(members),), float(s)) for _, s, _ in groups])
            variances.append((stds**2).double())
        # padded per class to the largest, so one batched matmul gives every sample its own
        # class's logits; padding has log-weight -1e30 (and a harmless variance of 1)
        pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
        self.centres, self.variances = pad(centres), pad(variances, padding_value=1.0)
        self.log_weights = pad([torch.zeros_like(part) for part in variances], padding_value=-1e30)
        self.norms = self.centres.square().sum(2)  # (10, M) |mu_m|^2
        # a fixed tiny text encoder: seeded word and position embeddings the policy attends to
        generator = torch.Generator().manual_seed(0)
        self.word_embeddings = torch.randn(len(DIGIT_VOCAB), DIGIT_WIDTH, generator=generator)
        self.position_embeddings = 0.1 * torch.randn(DIGIT_TOKENS, DIGIT_WIDTH, generator=generator)

    def check_prompts(self, prompts, reward=None):
        unknown = [prompt for prompt in prompts if prompt not in self.prompts]
        if unknown:
            raise ValueError(
                f"{self.name} knows only the prompts 'a handwritten 0' .. 'a handwritten 9', "
                f"got {shown(unknown[0])}"
            )

    def encode_prompts(self, prompts):
        self.check_prompts(prompts)
        tokens = [[DIGIT_VOCAB.index(word) for word in prompt.split()] + [0] for prompt in prompts]
        ids = torch.tensor(tokens)  # (N, S), ending in the padding token 0
        mask = ids != 0  # (N, S) True = token
        text = self.word_embeddings[ids] + self.position_embeddings  # (N, S, D)
        pooled = (text * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        label = torch.tensor([self.prompts.index(prompt) for prompt in prompts])
        cond = dict(prompt_embeds=text, text_mask=mask, pooled_prompt_embeds=pooled, label=label)
        return {key: value.to(self.device) for key, value in cond.items()}

    def default_times(self, steps):
        return torch.linspace(1.0, 0.0, steps + 1)

    def mixture(self, label):
        """The components of each sample's class, float64: centres (N, M, 64), their squared norms,
        variances s_m^2 and log-weights (N, M) (padding: -1e30)."""
        parts = (self.centres, self.norms, self.variances, self.log_weights)
        return tuple(part.to(label.device)[label] for part in parts)

    def velocity(self, state, t, mixture):
        """Exact E[noise - x_0 | x_t = state] at per-sample times t (N,), in the dtype of `mixture`
        (float64: the sharp mixtures' logits need it). Differentiable in state and t."""
        centres, norms, variances, log_weights = mixture
        x = state.reshape(state.shape[0], 64).to(centres.dtype)
        t = t.to(centres.dtype)[:, None]  # (N, 1)
        scale = 1.0 - t
        total = scale**2 * variances + t**2  # (N, M) v_m
        projection = torch.bmm(centres, x[:, :, None]).squeeze(2)  # (N, M) mu_m . x
        distance = x.square().sum(1, keepdim=True) - 2 * scale * projection + scale**2 * norms
        logits = log_weights - distance / (2 * total) - 32 * total.log()  # (d/2) log v_m, d = 64
        weights = torch.softmax(logits, dim=1)  # (N, M) posterior
        coefficient = weights * (t - scale * variances) / total  # (N, M) w_m c_m
        mixed = torch.bmm(torch.stack([coefficient, weights], 1), centres)  # (N, 2, 64)
        velocity = coefficient.sum(1, keepdim=True) * x - scale * mixed[:, 0] - mixed[:, 1]
        return velocity.reshape(state.shape)

    def ode(self, noise, cond, start):
        mixture = self.mixture(cond["label"])
        return (lambda state, t: self.velocity(state, t, mixture)), noise.float(), None

    @torch.no_grad()
    def reference(self, noise, cond):
        """Classical RK4 from t = 1 to 0 on the grid t_k = 1 - (k / steps) ** power, in
        reference_dtype (tests/test_rollout_digits.py bounds its error)."""
        steps, power, dtype = self.reference_steps, self.reference_power, self.reference_dtype
        fraction = torch.linspace(0.0, 1.0, steps + 1, dtype=torch.float64, device=self.device)
        grid = (1.0 - fraction**power).to(dtype)
        mixture = tuple(part.to(dtype) for part in self.mixture(cond["label"]))
        state = noise.to(dtype)

        def field(x, t):
            return self.velocity(x, t.expand(x.shape[0]), mixture)

        for step in range(steps):
            t, h = grid[step], grid[step + 1] - grid[step]
            k1 = field(state, t)
            k2 = field(state + h / 2 * k1, t + h / 2)
            k3 = field(state + h / 2 * k2, t + h / 2)
            k4 = field(state + h * k3, t + h)
            state = state + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return state.float()

    def decode(self, latents):
        images = ((latents.detach().float() + 1.0) / 2.0).clamp(0.0, 1.0)
        return images.expand(-1, 3, -1, -1).contiguous()
