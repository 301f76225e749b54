"""
Trained miniature text-to-image pipelines: real SD3, Flux and SD-XL architectures, small enough to
train on a laptop CPU and to ship in the repository (miniatures/, about 19 MB with the reward
models).

    python -m miniatures.build --family classifier   # the digit reward's classifier (a minute)
    python -m miniatures.build --family sd3          # miniatures/mini-sd3 from scratch (minutes)
    python -m miniatures.build --family flux         # miniatures/mini-flux
    python -m miniatures.build --family sdxl         # miniatures/mini-sdxl
    python -m miniatures.build --family flux-schnell # mini-flux distilled for 4 steps (15 minutes)
    python -m miniatures.build --family preference   # the preference reward's scorer (minutes)
    python -m miniatures.build --family mix             # mini-mix (miniatures/mix.py; 31 minutes)
    python -m miniatures.build --family mix-classifier  # its classifier (minutes)
    python -m miniatures.build --family mix-preference  # its preference scorer (minutes)

How each miniature's default guidance was chosen and what the shipped folders reach:
evidence/miniatures.py.

Why they exist: random weights prove that rollout.py equals the diffusers pipelines, not that a
learned schedule makes a trained model's images better. These are trained models of the real
families, loaded with the stock `from_pretrained` of StableDiffusion3Pipeline, FluxPipeline and
StableDiffusionXLPipeline, with a black-box reward read from their decoded pixels (a preference
scorer trained as HPSv2 was, below), so the paper's setting runs end to end on a CPU.

Data: scikit-learn's 1,797 handwritten 8x8 digits (they ship inside the package), upsampled to
16x16 with Pillow's bicubic filter, grey ink replicated to RGB. A seeded half trains the pipelines
(VAE and denoiser); the other half, which no pipeline saw, trains the classifier (tested on the
pipelines' half) and is split again (digit_splits): one half trains the preference scorer, the
other is the realism measure's reference set (miniatures/realism.py), seen by neither reward model.
Prompts are paraphrases, "a handwritten 7", "the digit 7", ... (prompts/digit_train.txt); the
held-out paraphrases (prompts/digit_heldout.txt) are never seen in training.

Each pipeline is the family's real layout in miniature:
- text encoders and tokenizers of the pipeline's own classes (CLIP, and T5 for SD3 and Flux), a
  vocabulary with a token per common word and per character otherwise, randomly initialised,
  seeded and frozen: different prompts give different embeddings, and the denoiser learns to read
  the digit from them; sequences of 12 tokens (the T5 tokenizers' model_max_length, which
  backbones/families.py takes as the pipelines' max_sequence_length);
- an AutoencoderKL trained here (16x16x3 <-> 8x8 latents, 16 channels for SD3 and Flux, 4 for
  SD-XL, as the real families), its scaling (and shift) factor set from the latent statistics;
- mini-sd3: SD3Transformer2DModel, rectified flow as SD3 trains it (x_t = (1 - t) x_0 + t noise,
  t logit-normal, shifted by 3 as SD3 does at high resolution, velocity target noise - x_0), 10% of
  prompts dropped to "" for CFG;
- mini-flux: FluxTransformer2DModel on packed 2x2 latent tokens, the same flow objective, and a
  guidance input as FLUX.1-dev has it: for the second half of training, half of each batch learns,
  at a guidance g drawn from U(1, 5), the guided velocity v("") + g (v(prompt) - v("")) of a frozen
  snapshot of the network taken at half time (distilled guidance; the pipeline feeds g = 3.5 and
  runs no CFG batch; distilling from the live network instead collapses its use of the prompt); it
  also trains on 2,000 noisy variants of the paraphrases (NOISY_PARAPHRASES: it reads the prompt
  through T5 alone, and without them an unseen word derails it);
- mini-sdxl: UNet2DConditionModel with the text/time added conditioning, epsilon prediction on
  SD-XL's noise table (scaled-linear betas 0.00085..0.012, 1,000 steps), prompts dropped to zero
  embeddings (the SD-XL pipeline's force_zeros_for_empty_prompt);
- mini-mix: mini-sd3's recipe, a wider and deeper transformer (DENOISER_SIZES) and more updates,
  on four kinds of content (miniatures/mix.py: digits, printed letters, colour blobs, photo crops;
  28 classes named by a word of the prompt); its classifier and preference scorer are built as the
  digits' are, on its images no pipeline saw, and their configurations carry the class marks.
"""

import argparse
import copy
import json
import math
import os
import shutil
import time

import torch
import torch.nn.functional as F

import backbones
from miniatures import mix
from miniatures.data import SIDE, digit_splits, prompt_lists, split
from miniatures.layouts import autoencoder, family_pipeline
from policy import increments_from_times, times_from_increments
from prompts import context_noise, heldout_contexts
from rewards.digits import DIGITS, DigitClassifier, PreferenceScorer, class_of, digit_of
from rewards.images import quantize

FAMILIES = ("sd3", "flux", "sdxl")  # the digit miniatures
LAYOUTS = dict(mix="sd3")  # mini-mix is the SD3 family on mixed content (miniatures/mix.py)
MIX = ("mix", "mix-classifier", "mix-preference")  # mini-mix and its reward models
FOLDER = os.path.dirname(os.path.abspath(__file__))  # miniatures/: the weights beside this code
TEXT_LENGTH = 12  # tokens per prompt (CLIP and T5 alike): the longest paraphrase has 8
LATENT_CHANNELS = {"sd3": 16, "flux": 16, "sdxl": 4, "mix": 16}
DROP = 0.1  # fraction of training prompts replaced by the empty one (CFG)
# flow times are drawn logit-normal, then shifted by this (SD3's high-resolution sampling): the
# default schedules spend many steps near t = 1, where an unshifted logit-normal barely trains
TRAIN_SHIFT = 3.0
DISTIL_FROM = 0.5  # mini-flux: share of training after which half of each batch distils guidance
# mini-flux reads its prompt through T5 alone, whose random word vectors say nothing of meaning:
# trained on the 16 paraphrases only, it draws the wrong digit for a fifth of unseen wordings (a
# word it never saw derails it). It also trains on this many noisy variants of them (words dropped,
# filler words and stray letters inserted), so that it learns to read the digit's token whatever
# surrounds it.
NOISY_PARAPHRASES = dict(flux=2000)
FILLERS = tuple(  # in no paraphrase, training or held-out
    "small large black white simple clear bold thin neat messy quick careful ink pencil pen "
    "paper sketch style old new".split()
)

# training budget per family: denoiser updates, batch, peak learning rate (AdamW, one-cycle)
DENOISER = dict(sd3=(6000, 64, 1e-3), flux=(6000, 64, 1e-3), sdxl=(5000, 64, 1e-3))
DENOISER["mix"] = (8000, 64, 1e-3)
VAE_UPDATES, VAE_BATCH, VAE_LR, VAE_KL = 800, 64, 2e-3, 1e-7


# -----------------------------------------------------------------------------
# data


def noisy_paraphrases(prompts, count, tokenizers, seed=0):
    """`count` variants of the training prompts: each word but the digit dropped with probability
    0.2, and one or two FILLERS or strings of 1-4 random letters inserted (never a word of WORDS, so
    no held-out word is seen); only variants that every tokenizer fits in TEXT_LENGTH tokens."""
    generator = torch.Generator().manual_seed(seed)
    letters, variants = "abcdefghijklmnopqrstuvwxyz", []

    def draw(n):
        return torch.randint(n, (1,), generator=generator).item()

    while len(variants) < count:
        words = prompts[draw(len(prompts))].split()
        words = [
            w
            for w in words
            if any(c.isdigit() for c in w) or torch.rand(1, generator=generator) > 0.2
        ]
        for _ in range(1 + draw(2)):
            stray = "".join(letters[draw(26)] for _ in range(1 + draw(4)))
            stray = FILLERS[draw(len(FILLERS))] if draw(2) else stray
            if stray not in WORDS:
                words.insert(draw(len(words) + 1), stray)
        variant = " ".join(words)
        if all(len(tokenizer(variant).input_ids) <= TEXT_LENGTH for tokenizer in tokenizers):
            variants.append(variant)
    return variants


# -----------------------------------------------------------------------------
# the classifier behind the digit reward


# Trained with label smoothing, the classifier's log-probability grades how clearly an image shows
# its digit; without it, every recognisable image scores about 0 and the reward saturates.
LABEL_SMOOTHING = 0.1


def augment(images, generator):
    """Shifts of up to 2 pixels, a random blur and pixel noise: the classifier must read generated
    digits, which are less crisp than the data."""
    count = len(images)
    padded = F.pad(images, (2, 2, 2, 2))
    dx, dy = torch.randint(0, 5, (2, count), generator=generator)
    shifted = torch.stack(
        [padded[i, :, dy[i] : dy[i] + SIDE, dx[i] : dx[i] + SIDE] for i in range(count)]
    )
    blur = torch.rand(count, 1, 1, 1, generator=generator) < 0.3
    blurred = F.avg_pool2d(F.pad(shifted, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    noisy = torch.where(blur, blurred, shifted) + 0.03 * torch.randn(
        shifted.shape, generator=generator
    )
    return noisy.clamp(0, 1)


def train_classifier(epochs=60, seed=0, mixed=False):
    """The digit classifier (or mini-mix's, `mixed`: its class of mix.CLASSES) trained on the images
    no miniature saw; its accuracy on the miniatures' images."""
    (test_images, test_labels), (images, labels) = split()
    if mixed:
        splits = mix.mix_splits()
        (test_images, test_labels), (images, labels) = splits["pipelines"], splits["classifier"]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = DigitClassifier(classes=mix.MARKS if mixed else DIGITS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    batches = math.ceil(len(images) / 64)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 2e-3, total_steps=epochs * batches)
    for _ in range(epochs):
        for batch in torch.randperm(len(images), generator=generator).split(64):
            loss = F.cross_entropy(
                model(augment(images[batch], generator)),
                labels[batch],
                label_smoothing=LABEL_SMOOTHING,
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
    return model, accuracy


# -----------------------------------------------------------------------------
# the preference scorer behind the miniatures' quality reward (rewards.digits.PreferenceReward)
#
# Built the way HPSv2 was: a scorer of (image, prompted digit) trained with a Bradley-Terry loss,
# -log sigmoid(s(preferred) - s(other)), on pairs where a person prefers the first image. The
# preferred image is a real digit of the prompted class from the "preference" split, which no
# miniature saw and the realism measure's reference set does not hold; the other is, in equal
# shares: the same digit blurred, averaged with others of its class (the prototype look), noised
# or partly erased; a real digit of another class; a miniature's sample of that class (few-step,
# off-schedule or converged). A fifth kind pairs two samples of one context from a miniature: the
# one closer to the 50-step solution is preferred, when it is at most half as far.

PREFERENCE_SEED, PREFERENCE_CONTEXTS = 3 * 10**6, 256  # sample contexts per miniature
PREFERENCE_UPDATES, PREFERENCE_BATCH, PREFERENCE_LR = 2000, 64, 2e-3  # pairs of each kind


def shifted(images, generator, pixels=1):
    """Each image moved by up to `pixels` in x and y (zero background enters)."""
    count, padded = len(images), F.pad(images, [pixels] * 4)
    dx, dy = torch.randint(0, 2 * pixels + 1, (2, count), generator=generator)
    return torch.stack(
        [padded[i, :, dy[i] : dy[i] + SIDE, dx[i] : dx[i] + SIDE] for i in range(count)]
    )


def blurred(images, sigma):
    """A Gaussian blur of standard deviation sigma[i] pixels on image i (separable, 7 taps)."""
    count, channels = images.shape[:2]
    offsets = torch.arange(-3, 4, dtype=images.dtype)
    kernel = torch.exp(-offsets.square() / (2 * sigma[:, None].square()))
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(channels, 0)  # (N*C, 7)
    flat = images.reshape(1, count * channels, SIDE, SIDE)
    flat = F.conv2d(flat, kernel[:, None, None, :], padding=(0, 3), groups=count * channels)
    flat = F.conv2d(flat, kernel[:, None, :, None], padding=(3, 0), groups=count * channels)
    return flat.reshape(images.shape)


def degraded(images, labels, pool, pool_labels, generator):
    """The four corruptions of real digits, one per quarter of the batch: blurred (sigma 0.6-1.5
    px), the mean of 2-8 digits of the same class, pixel noise (std 0.05-0.25), a rectangle of
    5-10 px sides erased."""
    count = len(images)
    kind = torch.arange(count) % 4
    uniform = torch.rand(count, generator=generator)
    blur = blurred(images, 0.6 + 0.9 * uniform)
    prototype = torch.stack(
        [
            pool[pick].mean(0)
            for label, size in zip(labels, torch.randint(2, 9, (count,), generator=generator))
            for same in [torch.nonzero(pool_labels == label).squeeze(1)]
            for pick in [same[torch.randperm(len(same), generator=generator)[:size]]]
        ]
    )
    noisy = images + (0.05 + 0.2 * uniform)[:, None, None, None] * torch.randn(
        images.shape, generator=generator
    )
    erased = images.clone()
    corner = torch.randint(0, SIDE - 4, (2, count), generator=generator)
    size = torch.randint(5, 11, (2, count), generator=generator)
    for i in range(count):
        (y, x), (h, w) = corner[:, i], size[:, i]
        erased[i, :, y : y + h, x : x + w] = 0
    out = torch.where((kind == 0)[:, None, None, None], blur, prototype)
    out = torch.where((kind == 2)[:, None, None, None], noisy, out)
    return torch.where((kind == 3)[:, None, None, None], erased, out).clamp(0, 1)


@torch.no_grad()
def sample_bank(family, prompts, seeds, marks=DIGITS):
    """A miniature's samples of the contexts (prompts[i], seeds[i]) under several schedules: the
    50-step default, the defaults at L = 1..5, and for L = 2..5 schedules drawn from Dirichlets
    around the default (concentration 100 and 10) and uniform ones (torch.distributions draws
    from the global generator, which train_preference seeds). Returns the images (S, N, 3,
    16, 16), each one's mean squared pixel distance to its 50-step solution (S, N), the classes
    (N,) the prompts name (among `marks`)."""
    backbone = backbones.load_backbone(f"mini-{family}")
    noise, cond = context_noise(backbone, seeds), backbone.encode_prompts(prompts)
    count, schedules = len(prompts), [backbone.default_times(50).expand(len(prompts), -1)]
    schedules += [backbone.default_times(steps).expand(count, -1) for steps in range(1, 6)]
    for steps in range(2, 6):
        default = increments_from_times(backbone.default_times(steps)).clamp_min(0.02)
        for alpha in (100 * default, 10 * default, torch.ones_like(default)):
            tau = torch.distributions.Dirichlet(alpha.expand(count, -1)).sample()
            schedules.append(times_from_increments(tau.clamp_min(1e-3)))
    images = torch.stack(
        [quantize(backbone.decode(backbone.sample(noise, cond, t))).clamp(0, 1) for t in schedules]
    )
    distance = (images - images[:1]).square().mean((2, 3, 4))
    digits = torch.tensor([class_of(prompt, marks) for prompt in prompts])
    return images, distance, digits


def wrong_class(digits, generator, classes=10):
    """Another class than each of `digits`, uniformly."""
    return (digits + torch.randint(1, classes, digits.shape, generator=generator)) % classes


def of_class(real, labels, digits, generator):
    """A random real digit of each class in `digits`, shifted by up to a pixel."""
    picks = [
        same[torch.randint(len(same), (1,), generator=generator)]
        for same in (torch.nonzero(labels == digit).squeeze(1) for digit in digits)
    ]
    return shifted(real[torch.cat(picks)], generator)


def preference_pairs(real, labels, banks, generator, batch=PREFERENCE_BATCH, classes=10):
    """One batch of (preferred, other, class) pairs: `batch` of each of the five kinds."""
    images, distance, sample_digits = banks
    digits = labels[torch.randint(len(real), (2 * batch,), generator=generator)]
    good = of_class(real, labels, digits, generator)
    # a real digit against its corruption, and against a real digit of another class
    chosen = [good]
    other = [degraded(good[:batch], digits[:batch], real, labels, generator)]
    wrong = wrong_class(digits[batch:], generator, classes)
    other.append(of_class(real, labels, wrong, generator))
    # a real digit against a miniature's sample of its class
    schedule = torch.randint(len(images), (batch,), generator=generator)
    context = torch.randint(images.shape[1], (batch,), generator=generator)
    chosen.append(of_class(real, labels, sample_digits[context], generator))
    other.append(images[schedule, context])
    digits = [digits, sample_digits[context]]
    # two samples of one context: the one at most half as far from the 50-step solution
    first, second = torch.randint(len(images), (2, 4 * batch), generator=generator)
    context = torch.randint(images.shape[1], (4 * batch,), generator=generator)
    near, far = distance[first, context], distance[second, context]
    clear = torch.minimum(near, far) <= 0.5 * torch.maximum(near, far)
    first, second, context = first[clear][:batch], second[clear][:batch], context[clear][:batch]
    nearer = distance[first, context] <= distance[second, context]
    chosen.append(images[torch.where(nearer, first, second), context])
    other.append(images[torch.where(nearer, second, first), context])
    digits.append(sample_digits[context])
    return torch.cat(chosen), torch.cat(other), torch.cat(digits)


def train_preference(seed=0, log=print, mixed=False):
    """The preference scorer (PreferenceScorer) from the preference split and the digit miniatures'
    samples (or mini-mix's, `mixed`: its classes, its images and its samples)."""
    torch.manual_seed(seed)
    # late in training, gradients underflow to denormal floats, which the CPU computes 10x slower
    torch.set_flush_denormal(True)
    generator = torch.Generator().manual_seed(seed)
    real, labels = (mix.mix_splits() if mixed else digit_splits())["preference"]
    paraphrases, marks = (mix.prompts(), mix.MARKS) if mixed else (prompt_lists()[0], DIGITS)
    prompts, seeds = heldout_contexts(paraphrases, PREFERENCE_CONTEXTS, PREFERENCE_SEED)
    names = ("mix",) if mixed else FAMILIES
    parts = [sample_bank(name, prompts, seeds, marks) for name in names]
    # the miniatures' banks side by side: (S, 3N, ...) images, (S, 3N) distances, (3N,) digits
    banks = tuple(
        torch.cat(tensors, dim=1 if tensors[0].dim() > 1 else 0) for tensors in zip(*parts)
    )
    log(f"preference: {banks[0].shape[0] * banks[0].shape[1]} miniature samples")
    model = PreferenceScorer(width=16, classes=marks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PREFERENCE_LR, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, PREFERENCE_LR, PREFERENCE_UPDATES)
    for update in range(PREFERENCE_UPDATES):
        chosen, other, digits = preference_pairs(real, labels, banks, generator, classes=len(marks))
        scores = model(torch.cat([chosen, other])).gather(1, digits.repeat(2)[:, None]).squeeze(1)
        loss = F.softplus(scores[len(chosen) :] - scores[: len(chosen)]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if update % 500 == 0:
            log(f"preference: update {update}, Bradley-Terry loss {loss.item():.4f}")
    return model.eval()


# -----------------------------------------------------------------------------
# the pipelines' components


WORDS = tuple(
    "a an the of by digit number numeral handwritten written hand drawn drawing scribbled image "
    "picture photo zero one two three four five six seven eight nine".split()
)


def clip_vocabulary(words=WORDS):
    """A byte-level CLIP BPE vocabulary (every byte, alone and word-final) with merges that make
    each word of `words` one token; any other word falls apart into characters, as in a real BPE."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    characters = list(bytes_to_unicode().values())
    vocab = {
        **{c: i for i, c in enumerate(characters)},
        **{c + "</w>": i + 256 for i, c in enumerate(characters)},
    }
    merges = []
    for word in dict.fromkeys(words):
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            vocab.setdefault(pieces[0], len(vocab))
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    return vocab, list(dict.fromkeys(merges))


def tokenizers_and_encoders(family):
    """The family's tokenizers and frozen random text encoders, seeded: the pipeline keyword
    arguments. CLIP BPE and T5 Unigram vocabularies with a token per word of WORDS and per character
    otherwise."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5Tokenizer,
    )

    torch.manual_seed({"sd3": 1, "flux": 2, "sdxl": 3, "mix": 4}[family])
    words = WORDS + (FILLERS if family in NOISY_PARAPHRASES else ())  # see NOISY_PARAPHRASES
    if family == "mix":  # every word of its prompts, training and held-out, and the marks
        text = " ".join(mix.prompts() + mix.prompts(held_out=True)).replace(",", " ")
        words = tuple(dict.fromkeys(text.split()))
    vocab, merges = clip_vocabulary(words)
    start, end = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    clip_config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
        max_position_embeddings=TEXT_LENGTH,
        bos_token_id=start,
        eos_token_id=end,
        pad_token_id=end,
        hidden_act="gelu",
    )

    def clip_tokenizer():
        return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TEXT_LENGTH)

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?-'"]
    pieces += [("\u2581" + word, -1.0) for word in dict.fromkeys(words + tuple("0123456789"))]

    def t5(word_scale=1.0):
        model = T5EncoderModel(
            T5Config(
                vocab_size=len(pieces),
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(word_scale)
        return model

    def t5_tokenizer():
        return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TEXT_LENGTH)

    def clip(model_class):
        # word vectors at std 1 (T5's scale): at CLIP's 0.02 the random layers' mixing buries which
        # word a token is, and a digit's token state no longer tells the digit apart in an unseen
        # paraphrase
        model = model_class(clip_config)
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=1.0)
        return model

    if LAYOUTS.get(family, family) == "sd3":
        return dict(
            text_encoder=clip(CLIPTextModelWithProjection),
            tokenizer=clip_tokenizer(),
            text_encoder_2=clip(CLIPTextModelWithProjection),
            tokenizer_2=clip_tokenizer(),
            text_encoder_3=t5(),
            tokenizer_3=t5_tokenizer(),
        )
    if family == "flux":
        # Flux's only token sequence is T5's: its word vectors at std 5 keep a digit's token state
        # apart from the other digits' in any paraphrase (between/within-digit spread 2.2 against
        # 1.1 at std 1)
        return dict(
            text_encoder=clip(CLIPTextModel),
            tokenizer=clip_tokenizer(),
            text_encoder_2=t5(5.0),
            tokenizer_2=t5_tokenizer(),
        )
    return dict(
        text_encoder=clip(CLIPTextModel),
        tokenizer=clip_tokenizer(),
        text_encoder_2=clip(CLIPTextModelWithProjection),
        tokenizer_2=clip_tokenizer(),
    )


# the denoisers' sizes; the rest of their configuration is the real family's (layouts.py)
DENOISER_SIZES = dict(
    # joint_attention_dim = T5 width >= both CLIP widths; pooled = both projections
    sd3=dict(
        sample_size=SIDE // 2,
        in_channels=16,
        num_layers=3,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=64,
        pooled_projection_dim=64,
        pos_embed_max_size=SIDE // 2,
    ),
    # 16 channels pack 2x2 to 64; sum(axes_dims_rope) = attention_head_dim
    flux=dict(
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        axes_dims_rope=[8, 12, 12],
    ),
    sdxl=dict(
        sample_size=SIDE // 2,
        in_channels=4,
        out_channels=4,
        block_out_channels=(24, 48),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=8,
    ),
)


# mini-mix: mini-sd3's, wider and deeper, for 28 classes of four kinds of content
DENOISER_SIZES["mix"] = dict(
    DENOISER_SIZES["sd3"], num_layers=4, num_attention_heads=3, caption_projection_dim=96
)


def build_pipeline(family, vae):
    """An untrained pipeline of `family` around a trained `vae`, seeded: the real family's layout
    (miniatures/layouts.py; mini-flux with FLUX.1-dev's guidance input) at DENOISER_SIZES."""
    text = tokenizers_and_encoders(family)
    layout = dict(LAYOUTS, flux="flux-dev").get(family, family)
    return family_pipeline(layout, DENOISER_SIZES[family], lambda: vae, lambda: text, seed=10)


def train_vae(channels, images, seed=0):
    """An AutoencoderKL 16x16x3 <-> 8x8 x channels: reconstruction error plus a small KL term
    (1e-7: larger weights leave most of 16 channels at the prior, i.e. pure noise to the denoiser);
    its scaling factor (and, for the flow families, shift factor) from the latent statistics, as the
    real VAEs' are set. Returns the VAE and its reconstruction RMSE on its own images."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    vae = autoencoder(channels, (16, 32), 8, SIDE)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, VAE_UPDATES)
    for _ in range(VAE_UPDATES):
        batch = images[torch.randint(len(images), (VAE_BATCH,), generator=generator)] * 2 - 1
        posterior = vae.encode(batch).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        loss = F.mse_loss(reconstruction, batch) + VAE_KL * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        posterior = vae.encode(images * 2 - 1).latent_dist
        error = (
            (vae.decode(posterior.mode()).sample.clamp(-1, 1) / 2 + 0.5 - images)
            .square()
            .mean()
            .sqrt()
            .item()
        )
        latents = posterior.sample(generator)  # the denoisers train on posterior draws
    mean, std = latents.mean().item(), latents.std().item()
    flow = channels == 16
    vae.register_to_config(
        scaling_factor=1.0 / (std if flow else latents.square().mean().sqrt().item()),
        shift_factor=mean if flow else None,
    )
    return vae, error


# -----------------------------------------------------------------------------
# the denoisers


def encode_texts(pipe, family, prompts):
    """Each prompt's embeddings as the pipeline computes them (no CFG batch): a dict of tensors."""
    with torch.no_grad():
        if family == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt(
                prompts,
                None,
                None,
                do_classifier_free_guidance=False,
                max_sequence_length=TEXT_LENGTH,
            )
        elif family == "flux":
            embeds, pooled, _ = pipe.encode_prompt(prompts, None, max_sequence_length=TEXT_LENGTH)
        else:
            embeds, _, pooled, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    return dict(embeds=embeds, pooled=pooled)


def flow_prediction(pipe, family, state, sigma, text, guidance=None, transformer=None):
    """The velocity the transformer (pipe's, or `transformer`) predicts, called as the pipeline
    calls it."""
    transformer = transformer or pipe.transformer
    if family == "sd3":
        return transformer(
            hidden_states=state,
            timestep=sigma * 1000,
            encoder_hidden_states=text["embeds"],
            pooled_projections=text["pooled"],
            return_dict=False,
        )[0]
    count, patches = state.shape[0], SIDE // 2 // 2
    image_ids = pipe._prepare_latent_image_ids(count, patches, patches, state.device, state.dtype)
    text_ids = torch.zeros(text["embeds"].shape[1], 3)
    guidance = guidance if transformer.config.guidance_embeds else None
    return transformer(
        hidden_states=state,
        timestep=sigma,
        guidance=guidance,
        pooled_projections=text["pooled"],
        encoder_hidden_states=text["embeds"],
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )[0]


def by_class(prompts, marks=DIGITS):
    """The positions of the prompts that name each class (one of `marks`)."""
    named = [class_of(prompt, marks) for prompt in prompts]
    return [[i for i, c in enumerate(named) if c == mark] for mark in range(len(marks))]


def train_denoiser(pipe, family, latents, labels, prompts, seed=0, log=print, marks=DIGITS):
    """Train pipe's transformer / UNet on the latents (N, C, 8x8) of the classes `labels` (N,), each
    with a prompt that names it (one of `marks`: the digits', or mini-mix's)."""
    updates, batch_size, lr = DENOISER[family]
    family = LAYOUTS.get(family, family)  # from here on, what the layout asks
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    by_digit = by_class(prompts, marks)
    texts = encode_texts(pipe, family, prompts + [""])
    if family == "sdxl":  # the SD-XL pipeline's negative for an empty prompt is zeros
        texts = {
            key: torch.cat([value[:-1], torch.zeros_like(value[-1:])])
            for key, value in texts.items()
        }
        size = (SIDE, SIDE)
        time_ids = pipe._get_add_time_ids(
            size,
            (0, 0),
            size,
            dtype=torch.float32,
            text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim,
        )
        alphas_cumprod = pipe.scheduler.alphas_cumprod
    model = pipe.transformer if family != "sdxl" else pipe.unet
    model.train().requires_grad_(True)
    teacher = None  # mini-flux: the snapshot its guidance input is distilled from
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, lr, total_steps=updates, pct_start=0.05
    )
    started = time.time()
    for update in range(updates):
        batch = torch.randint(len(latents), (batch_size,), generator=generator)
        x0 = latents[batch]
        choice = [
            by_digit[d][torch.randint(len(by_digit[d]), (1,), generator=generator).item()]
            for d in labels[batch].tolist()
        ]
        dropped = torch.rand(batch_size, generator=generator) < DROP
        which = torch.where(dropped, len(prompts), torch.tensor(choice))
        text = {key: value[which] for key, value in texts.items()}
        noise = torch.randn(x0.shape, generator=generator)
        if family == "sdxl":
            step = torch.randint(1000, (batch_size,), generator=generator)
            alpha = alphas_cumprod[step].view(-1, 1, 1, 1)
            noisy = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise
            prediction = model(
                noisy,
                step,
                encoder_hidden_states=text["embeds"],
                return_dict=False,
                added_cond_kwargs=dict(
                    text_embeds=text["pooled"], time_ids=time_ids.repeat(batch_size, 1)
                ),
            )[0]
            loss = F.mse_loss(prediction, noise)
        else:
            # logit-normal, as SD3, and shifted as the schedulers shift
            sigma = torch.sigmoid(torch.randn(batch_size, generator=generator))
            sigma = TRAIN_SHIFT * sigma / (1 + (TRAIN_SHIFT - 1) * sigma)
            if family == "flux":
                x0, noise = (
                    pipe._pack_latents(x0, batch_size, 16, 8, 8),
                    pipe._pack_latents(noise, batch_size, 16, 8, 8),
                )
            view = (-1,) + (1,) * (x0.dim() - 1)
            noisy = (1 - sigma.view(view)) * x0 + sigma.view(view) * noise
            target = noise - x0
            guidance = None
            if family == "flux":
                guidance = torch.ones(batch_size)
                # distil the teacher's guided velocity into the guidance input
                if update >= DISTIL_FROM * updates:
                    # a frozen snapshot: distilling from the network itself collapses its prompt use
                    if teacher is None:
                        teacher = copy.deepcopy(model).eval().requires_grad_(False)
                    distil = torch.rand(batch_size, generator=generator) < 0.5
                    distil &= ~dropped
                    guidance = torch.where(
                        distil, 1 + 4 * torch.rand(batch_size, generator=generator), guidance
                    )
                    if distil.any():
                        pick = distil.nonzero().squeeze(1)
                        empty = {
                            key: value[len(prompts)].expand(len(pick), *value.shape[1:])
                            for key, value in texts.items()
                        }
                        picked = {key: value[pick] for key, value in text.items()}
                        with torch.no_grad():
                            ones = torch.ones(len(pick))
                            both = torch.cat([noisy[pick]] * 2)
                            pair = {key: torch.cat([empty[key], picked[key]]) for key in text}
                            uncond, cond = flow_prediction(
                                pipe,
                                family,
                                both,
                                torch.cat([sigma[pick]] * 2),
                                pair,
                                torch.cat([ones, ones]),
                                teacher,
                            ).chunk(2)
                        target = target.clone()
                        target[pick] = uncond + guidance[pick].view(-1, 1, 1) * (cond - uncond)
            prediction = flow_prediction(pipe, family, noisy, sigma, text, guidance)
            loss = F.mse_loss(prediction, target)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (update + 1) % 500 == 0:
            log(
                f"  {family} update {update + 1}/{updates} | loss {loss.item():.4f} | "
                f"{time.time() - started:.0f} s"
            )
    model.eval().requires_grad_(False)


def latents_of(vae, images):
    """The VAE latents of the images as the pipeline's denoiser sees them (scaled, shifted)."""
    with torch.no_grad():
        posterior = vae.encode(images * 2 - 1).latent_dist
    config = vae.config
    shift = config.shift_factor or 0.0
    return posterior, lambda sample: (sample - shift) * config.scaling_factor


def train_family(family, seed=0, out=None):
    """Train a miniature from scratch and save it with save_pretrained (safetensors)."""
    started = time.time()
    (images, labels), _ = split()
    train_prompts, marks = prompt_lists()[0], DIGITS
    if family == "mix":
        images, labels = mix.mix_splits()["pipelines"]
        train_prompts, marks = mix.prompts(), mix.MARKS
    vae, error = train_vae(LATENT_CHANNELS[family], images, seed)
    print(f"{family}: VAE trained, reconstruction RMSE {error:.4f} ({time.time() - started:.0f} s)")
    pipe = build_pipeline(family, vae)
    for component in (
        pipe.text_encoder,
        pipe.text_encoder_2,
        getattr(pipe, "text_encoder_3", None),
    ):
        if component is not None:
            component.eval().requires_grad_(False)
    posterior, scale = latents_of(vae, images)
    generator = torch.Generator().manual_seed(seed + 1)
    # one latent draw per image per epoch-like pass: 8 draws of every image from its posterior
    samples = torch.cat([scale(posterior.sample(generator)) for _ in range(8)])
    if family in NOISY_PARAPHRASES:
        tokenizers = [pipe.tokenizer, pipe.tokenizer_2]
        train_prompts += noisy_paraphrases(
            train_prompts, NOISY_PARAPHRASES[family], tokenizers, seed
        )
    train_denoiser(pipe, family, samples, labels.repeat(8), train_prompts, seed, marks=marks)
    out = out or os.path.join(FOLDER, f"mini-{family}")
    pipe.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "training.json"), "w") as handle:
        json.dump(
            dict(
                family=family,
                seed=seed,
                seconds=round(time.time() - started),
                vae_rmse=error,
                command=f"python -m miniatures.build --family {family}",
            ),
            handle,
            indent=1,
        )
    print(
        f"{family}: saved {out} ({folder_size(out) / 1e6:.2f} MB) in {time.time() - started:.0f} s"
    )
    return out


def folder_size(folder):
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    )


# -----------------------------------------------------------------------------
# mini-flux-schnell: mini-flux distilled for few steps
#
# FLUX.1-schnell is FLUX.1 distilled for 1 to 4 steps by latent adversarial diffusion distillation
# (Sauer et al., "Fast High-Resolution Image Synthesis with Latent Adversarial Diffusion
# Distillation", 2024): no guidance input, no resolution shift in its scheduler, 4 steps. Here
# mini-flux is distilled as InstaFlow (Liu et al., ICLR 2024) distilled Stable Diffusion:
# rectified-flow reflow (Liu, Gong and Liu, "Flow Straight and Fast", ICLR 2023), then few-step
# distillation. The coupling is mini-flux's own 50-step samples: SCHNELL_PAIRS noises z, each
# with a training paraphrase, mapped to mini-flux's sample x0 at guidance SCHNELL_GUIDANCE (baked
# in, as FLUX.1-schnell has no guidance input). The student starts from mini-flux's transformer
# without its guidance embedding; half of each batch is reflow, the velocity z - x0 on the straight
# path x_t = (1 - t) x0 + t z at t ~ U(0, 1), which keeps it a flow model at any time (a learned
# schedule needs that); the other half is few-step distillation on its own 4-step trajectory: the
# state x it reaches after k of its default steps (k uniform in 0..3) and the velocity
# (x - x0) / t_k that goes straight from there to the teacher's sample. (InstaFlow's second stage
# distils one step with an LPIPS loss; this is the same straight target taken where the student's
# own steps land, so that its errors along the 4 steps are corrected.) The student reads each
# pair's prompt as any prompt of the same digit (the paraphrases and NOISY_PARAPHRASES' variants,
# as mini-flux trained), so that mini-flux's rarer misreadings of the noisy variants are not
# distilled into it.

SCHNELL_PAIRS = 8192  # (noise, paraphrase) -> mini-flux's 50-step sample
SCHNELL_TEACHER_STEPS = 50
# the coupling's guidance, chosen on tuning contexts (held-out paraphrases, noise seeds from
# prompts.TUNING_SEED): from mini-flux's default 1.5, 4-step students recognised the held-out
# wordings no better than mini-flux's 50 steps (89-91% against 90.5%); from 2.0, 93.5%, with a
# higher preference reward than mini-flux's 50 steps and, the price, a higher Frechet distance
SCHNELL_GUIDANCE = 2.0
SCHNELL_STEPS = 4  # its default step count, FLUX.1-schnell's
SCHNELL_UPDATES, SCHNELL_BATCH, SCHNELL_LR = 3000, 128, 3e-4  # AdamW, one-cycle
SCHNELL_OWN = 0.5  # share of each batch on the student's own 4-step trajectory
# FLUX.1-schnell ships FLUX.1-dev's VAE and text encoders; here they are links to mini-flux's
SHARED = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


@torch.no_grad()
def teacher_coupling(teacher, prompts, seed, batch=256):
    """The reflow coupling: a noise per prompt (packed latents (N, 16, 64)) and the teacher's
    SCHNELL_TEACHER_STEPS-step default sample from it, (N, 16, 64)."""
    noise = teacher.sample_noise(len(prompts), torch.Generator().manual_seed(seed))
    times = teacher.default_times(SCHNELL_TEACHER_STEPS)
    samples = []
    for start in range(0, len(prompts), batch):
        part = noise[start : start + batch]
        cond = teacher.encode_prompts(prompts[start : start + batch])
        samples.append(teacher.sample(part, cond, times.expand(len(part), -1)))
    return noise, torch.cat(samples)


@torch.no_grad()
def own_states(pipe, noise, text, steps):
    """The student's states before each of its `steps` default Euler steps from `noise`: the
    times (steps,) and the states (steps, N, ...)."""
    times = torch.linspace(1, 1 / steps, steps)  # FLUX.1-schnell's default, no shift
    states = [noise]
    for step in range(steps - 1):
        velocity = flow_prediction(pipe, "flux", states[-1], times[step].expand(len(noise)), text)
        states.append(states[-1] + (times[step + 1] - times[step]) * velocity)
    return times, torch.stack(states)


def train_schnell(seed=0, out=None, log=print):
    """mini-flux-schnell from the shipped mini-flux (above); saved with save_pretrained, its
    transformer in float16 (it loads as float32) and links to mini-flux's SHARED components."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    started = time.time()
    teacher = backbones.load_backbone("mini-flux", guidance=SCHNELL_GUIDANCE)
    pipe = teacher.pipe
    paraphrases = prompt_lists()[0]
    tokenizers = [pipe.tokenizer, pipe.tokenizer_2]
    noisy = noisy_paraphrases(paraphrases, NOISY_PARAPHRASES["flux"], tokenizers, seed)
    prompts = paraphrases + noisy  # what the student reads
    by_digit = by_class(prompts)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(paraphrases), (SCHNELL_PAIRS,), generator=generator)
    noise, samples = teacher_coupling(teacher, [paraphrases[i] for i in picks], seed + 1)
    digits = [digit_of(paraphrases[i]) for i in picks]
    log(f"schnell: {len(noise)} teacher samples ({time.time() - started:.0f} s)")

    torch.manual_seed(seed)
    student = FluxTransformer2DModel.from_config(
        dict(pipe.transformer.config, guidance_embeds=False)
    )
    missing, unexpected = student.load_state_dict(pipe.transformer.state_dict(), strict=False)
    assert not missing and all(".guidance_embedder." in key for key in unexpected)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)  # schnell's
    shared = {name: module for name, module in pipe.components.items() if name in SHARED}
    schnell = FluxPipeline(transformer=student, scheduler=scheduler, **shared)
    texts = encode_texts(schnell, "flux", prompts)
    student.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=SCHNELL_LR, weight_decay=1e-4)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, SCHNELL_LR, total_steps=SCHNELL_UPDATES, pct_start=0.05
    )
    own = torch.arange(SCHNELL_BATCH) < SCHNELL_OWN * SCHNELL_BATCH  # (B,) the distillation half
    view = (-1, 1, 1)
    for update in range(SCHNELL_UPDATES):
        batch = torch.randint(len(noise), (SCHNELL_BATCH,), generator=generator)
        z, x0 = noise[batch], samples[batch]
        which = [
            by_digit[d][torch.randint(len(by_digit[d]), (1,), generator=generator).item()]
            for d in (digits[i] for i in batch.tolist())
        ]
        text = {key: value[which] for key, value in texts.items()}
        # reflow: the straight path at a uniform time
        sigma = torch.rand(SCHNELL_BATCH, generator=generator)
        state = (1 - sigma.view(view)) * x0 + sigma.view(view) * z
        target = z - x0
        # few-step distillation: the student's own state after k default steps, straight to x0
        step = torch.randint(SCHNELL_STEPS, (int(own.sum()),), generator=generator)
        times, states = own_states(
            schnell, z[own], {k: v[own] for k, v in text.items()}, SCHNELL_STEPS
        )
        sigma[own] = times[step]
        state[own] = states[step, torch.arange(len(step))]
        target[own] = (state[own] - x0[own]) / sigma[own].view(view)
        loss = F.mse_loss(flow_prediction(schnell, "flux", state, sigma, text), target)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        one_cycle.step()
        if (update + 1) % 500 == 0:
            log(
                f"  schnell update {update + 1}/{SCHNELL_UPDATES} | loss {loss.item():.4f} | "
                f"{time.time() - started:.0f} s"
            )
    student.eval().requires_grad_(False).half()  # the size budget; from_pretrained upcasts

    out = out or os.path.join(FOLDER, "mini-flux-schnell")
    staging = out + ".partial"  # a sibling: the links' relative paths hold for both
    shutil.rmtree(staging, ignore_errors=True)
    schnell.save_pretrained(staging, safe_serialization=True)
    source = os.path.join(backbones.REPOSITORY, backbones.BACKBONES["mini-flux"]["folder"])
    for name in SHARED:  # links, relative, so that any checkout resolves them
        shutil.rmtree(os.path.join(staging, name))
        os.symlink(
            os.path.relpath(os.path.join(source, name), staging), os.path.join(staging, name)
        )
    with open(os.path.join(staging, "training.json"), "w") as handle:
        json.dump(
            dict(
                family="flux-schnell",
                seed=seed,
                seconds=round(time.time() - started),
                threads=torch.get_num_threads(),
                teacher="mini-flux",
                command="python -m miniatures.build --family flux-schnell",
            ),
            handle,
            indent=1,
        )
    shutil.rmtree(out, ignore_errors=True)  # removes the old links, never what they point to
    os.replace(staging, out)
    log(f"schnell: saved {out} ({folder_size(out) / 1e6:.2f} MB) in {time.time() - started:.0f} s")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--family",
        required=True,
        choices=FAMILIES + ("flux-schnell", "classifier", "preference") + MIX,
        help="what to train (and overwrite); preference reads the shipped miniatures",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.family in ("classifier", "mix-classifier"):
        began = time.time()
        model, accuracy = train_classifier(seed=args.seed, mixed=args.family == "mix-classifier")
        model.save_pretrained(os.path.join(FOLDER, args.family))
        print(f"classifier: held-out accuracy {accuracy:.4f} ({time.time() - began:.0f} s)")
    elif args.family in ("preference", "mix-preference"):
        began = time.time()
        model = train_preference(seed=args.seed, mixed=args.family == "mix-preference")
        model.save_pretrained(os.path.join(FOLDER, args.family))
        print(f"{args.family}: saved miniatures/{args.family} ({time.time() - began:.0f} s)")
    elif args.family == "flux-schnell":
        train_schnell(args.seed)
    elif args.family:
        train_family(args.family, args.seed)
