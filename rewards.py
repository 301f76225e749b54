"""
Rewards: black-box scores of a rollout's final latents, higher is better.

    reward = load_reward("teacher", backbone)  # or "hpsv2", "clip", "ocr", "geneval"
    scores = reward(latents, prompts, noise, cond)  # (N,) float32 on the backbone's device
    # what evaluate.py reports: name -> (N,)
    columns = metrics(reward, "ocr", latents, prompts, noise, cond)

Every reward has that one signature, batched over N samples with one prompt each (the contexts of
a batch repeated K times with repeat_interleave), is built once and reused, and decodes with
`backbone.decode` itself when it needs images. `REWARDS` maps each name to its loader.

- "teacher": fidelity to the same frozen backbone's accurate solution `backbone.reference(noise,
  cond)` from the same noise and prompt: minus the per-sample mean squared error in latent space,
  so 0 is the best possible score. No reward model, works for every backbone, the default for
  digits. Teacher solutions are cached per context (hash of the noise bytes and the prompt): the K
  rollouts of a context cost one reference solve and a fixed held-out set is solved once.
- "hpsv2": Human Preference Score v2.1 (or v2.0), x100 as the paper reports HPSv2 (its text does not
  say which version; v2.1 is this project's choice): the cosine similarity of HPS's open_clip
  ViT-H-14 image and text embeddings. Needs requirements-hps.txt and
  the checkpoint HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2 (`checkpoint=` a local path).
- "clip": 100 x cosine similarity of a transformers CLIPModel's image and text embeddings
  (default openai/clip-vit-large-patch14, `checkpoint=` a hub id or local folder): a light
  prompt-alignment reward for machines without the HPS environment.
- "ocr" (ocr.py): word recall of the prompt's "quoted" text in what EasyOCR reads in the image, the
  paper's text-rendering reward; evaluate.py reports 1 - normalised edit distance beside it.
- "preference": the miniatures' HPSv2, the default reward of the mini-* backbones: a small scorer
  of (image, prompted digit) that miniature.py trains as HPSv2 was trained, with a Bradley-Terry
  loss on preference pairs (a real digit over the same digit blurred, averaged, noised, erased,
  over another digit, over a miniature's sample; of two samples, the one nearer convergence), on
  digits no miniature saw. A black box on their decoded pixels; evaluate.py reports the
  classifier's accuracy beside it, and realism.py the realism of the samples.
- "digit": log p(prompted digit | image) under the small classifier that miniature.py trains on
  digits the miniature pipelines never saw: prompt alignment only (it scores a blurry class mean
  above a real digit); evaluate.py reports its accuracy beside it.
- "geneval" (geneval.py): the fraction of a GenEval prompt's requirements (objects, counts,
  colours, positions) that Mask2Former and CLIP find met; evaluate.py reports GenEval's binary
  correctness beside it. Both read text or objects, which the 8x8 embedded backbones do not have.

Images are quantised to 8 bits before scoring, as the reward models were trained and evaluated on
8-bit images, and preprocessed on tensors to the same numbers as each model's own transform
(tests/test_rewards.py, tests/test_rewards_hps.py check this against the reference code).

Rewards are returned as computed, NaN included: the trainer stops at a non-finite reward rather
than dropping or clamping samples, which would bias the estimator and hide a broken model.
"""

import hashlib
import os
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin

from hub import hub_file
from preprocess import clip_preprocess, import_optional, normalize, quantize

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HPS_INSTALL = "pip install -r requirements-hps.txt && pip install --no-deps hpsv2x==1.2.0"
CLIP_DEFAULT = "openai/clip-vit-large-patch14"


def _unique(prompts):
    """Distinct prompts in order and, per sample, the index of its prompt among them."""
    unique = list(dict.fromkeys(prompts))
    position = {prompt: index for index, prompt in enumerate(unique)}
    return unique, [position[prompt] for prompt in prompts]


# ----------------------------------------------------------------------------------------------
# teacher: fidelity to the backbone's own accurate solution


def context_key(noise, prompt):
    """A context's identity: hash of its noise (shape, dtype and bytes) and its prompt."""
    noise = noise.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{tuple(noise.shape)}|{noise.dtype}|{prompt}|".encode())
    digest.update(noise.reshape(-1).view(torch.uint8).numpy().tobytes())  # of any dtype, bf16 too
    return digest.hexdigest()


class TeacherReward:
    """-mean((latents - backbone.reference(noise, cond))^2) per sample.

    The cache holds up to `cache_size` teacher solutions (least recently used evicted first) on the
    CPU, so device memory does not grow with it; 4096 covers a held-out set plus the contexts of
    many training batches. `hits` counts samples served without a solve (repeated contexts within
    a call included), `misses` counts reference solves.
    """

    def __init__(self, backbone, device=None, cache_size=4096):
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.cache_size = cache_size
        self.cache = OrderedDict()  # context key -> teacher latents (CPU)
        self.hits = 0
        self.misses = 0

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        noise_cpu = noise.detach().cpu()
        keys = [context_key(noise_cpu[index], prompt) for index, prompt in enumerate(prompts)]
        unsolved = {}  # key -> index of its first sample in this call
        for index, key in enumerate(keys):
            if key in self.cache:
                self.cache.move_to_end(key)
                self.hits += 1
            elif key in unsolved:
                self.hits += 1
            else:
                unsolved[key] = index
                self.misses += 1
        if unsolved:
            index = torch.tensor(list(unsolved.values()))
            sub_cond = {
                name: value[index.to(value.device)] if torch.is_tensor(value) else value
                for name, value in cond.items()
            }
            solved = self.backbone.reference(noise[index.to(noise.device)], sub_cond)
            for key, target in zip(unsolved, solved.detach().cpu()):
                self.cache[key] = target
        targets = torch.stack([self.cache[key] for key in keys]).to(self.device, torch.float32)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        error = (latents.detach().to(self.device, torch.float32) - targets) ** 2
        return -error.flatten(1).mean(1)


def load_teacher(backbone, device=None, cache_size=4096):
    return TeacherReward(backbone, device=device, cache_size=cache_size)


# ----------------------------------------------------------------------------------------------
# hpsv2: Human Preference Score v2 (Wu et al. 2023), through hpsv2x's own open_clip code


def hps_preprocess(images, size=224):
    """(N, 3, H, W) in [0, 1] -> (N, 3, size, size), HPS's inference transform on tensors.

    hpsv2 builds its transform with light_augmentation=True (hpsv2/src/open_clip/factory.py,
    create_model_and_transforms), i.e. image_transform(..., resize_longest_max=True) in
    hpsv2/src/open_clip/transform.py: ToTensor on the 8-bit image, then ResizeMaxSize: scale the
    longest side to `size` with torchvision's bicubic resize on the float tensor (antialiased),
    zero-pad the short side (half before, rest after), OpenAI CLIP mean/std. As ResizeMaxSize
    does, an image whose longest side is already `size` is left as it is.
    """
    images = quantize(images)
    height, width = images.shape[-2:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        # Python round, as ResizeMaxSize
        new_height, new_width = round(height * scale), round(width * scale)
        images = F.interpolate(
            images, (new_height, new_width), mode="bicubic", align_corners=False, antialias=True
        )
        pad_height, pad_width = size - new_height, size - new_width
        images = F.pad(
            images,
            (
                pad_width // 2,
                pad_width - pad_width // 2,
                pad_height // 2,
                pad_height - pad_height // 2,
            ),
        )
    return normalize(images)


# hpsv2's transforms need torchvision, which fails to import beside a mismatched torch
def _import_hps():
    return import_optional(
        ["torchvision", "hpsv2.src.open_clip"],
        "the hpsv2 reward needs hpsv2x and a matching torchvision",
        HPS_INSTALL,
    )


class HPSReward:
    """100 x cos(image, prompt) in HPS's embedding space, as hpsv2.img_score.score computes it."""

    def __init__(self, backbone, checkpoint, device=None, model_name="ViT-H-14", batch_size=16):
        open_clip = _import_hps()
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.batch_size = batch_size
        # pretrained=None: no LAION download, the HPS checkpoint below replaces every weight anyway
        model = open_clip.create_model(
            model_name, pretrained=None, precision="fp32", device="cpu", output_dict=True
        )
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state))  # strict, as hpsv2 loads it
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        image_size = model.visual.image_size
        self.image_size = image_size[0] if isinstance(image_size, (tuple, list)) else image_size

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        images = self.backbone.decode(latents)
        unique, which = _unique(prompts)
        tokens = self.tokenizer(unique).to(self.device)  # (P, 77)
        # fp16 autocast on CUDA as hpsv2.img_score.score runs it; plain float32 elsewhere
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.type == "cuda"):
            text = torch.cat(
                [
                    self.model.encode_text(chunk, normalize=True)
                    for chunk in tokens.split(self.batch_size)
                ]
            )
            image = torch.cat(
                [
                    self.model.encode_image(
                        hps_preprocess(chunk.to(self.device), self.image_size), normalize=True
                    )
                    for chunk in images.split(self.batch_size)
                ]
            )
        which = torch.tensor(which, device=self.device)
        return 100.0 * (image.float() * text.float()[which]).sum(-1)


def hps_checkpoint(version="v2.1", checkpoint=None):
    """The path of the HPS checkpoint: `checkpoint` (a local HPS_v2*.pt) if given, else the HF cache
    (downloaded when online). ValueError with one line saying how to get it."""
    if version not in HPS_FILES:
        raise ValueError(f"unknown HPS version {version!r}; known: {', '.join(HPS_FILES)}")
    filename = HPS_FILES[version]
    hint = (
        f"HPS {version} checkpoint not found: get {filename} from the hub repo {HPS_REPO} "
        f"(hf download {HPS_REPO} {filename}) or pass --reward-checkpoint PATH"
    )
    if checkpoint is None:
        return hub_file(HPS_REPO, filename, hint)
    if not os.path.isfile(checkpoint):
        raise ValueError(f"{hint}; no file at {checkpoint}")
    return checkpoint


def load_hpsv2(
    backbone, device=None, version="v2.1", checkpoint=None, model_name="ViT-H-14", batch_size=16
):
    """`checkpoint`: a local HPS_v2*.pt; else the HF cache (downloaded when online). `model_name`:
    an open_clip model config (the tests register a tiny one)."""
    checkpoint = hps_checkpoint(version, checkpoint)
    return HPSReward(
        backbone, checkpoint, device=device, model_name=model_name, batch_size=batch_size
    )


# ----------------------------------------------------------------------------------------------
# clip: CLIP text-image similarity through transformers, without torchvision


class CLIPReward:
    """100 x cos(image, prompt) in a CLIP model's projected embedding space."""

    def __init__(self, backbone, checkpoint=CLIP_DEFAULT, device=None, batch_size=32):
        from transformers import AutoTokenizer, CLIPModel

        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.batch_size = batch_size
        try:
            self.model = (
                CLIPModel.from_pretrained(checkpoint).to(self.device).eval().requires_grad_(False)
            )
            self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        except OSError as error:
            raise ValueError(
                f"CLIP model {checkpoint!r} not found ({type(error).__name__}): download it with "
                f"`hf download {checkpoint}` or pass --reward-checkpoint PATH to a local copy"
            ) from None
        self.image_size = self.model.config.vision_config.image_size
        self.max_length = self.model.config.text_config.max_position_embeddings

    def _text(self, prompts):
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        pooled = self.model.text_model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
        ).pooler_output
        return F.normalize(self.model.text_projection(pooled), dim=-1)

    def _image(self, images):
        pooled = self.model.vision_model(
            pixel_values=clip_preprocess(images.to(self.device), self.image_size)
        ).pooler_output
        return F.normalize(self.model.visual_projection(pooled), dim=-1)

    @torch.no_grad()
    def __call__(self, latents, prompts, noise, cond):
        images = self.backbone.decode(latents)
        unique, which = _unique(prompts)
        text = torch.cat(
            [
                self._text(unique[start : start + self.batch_size])
                for start in range(0, len(unique), self.batch_size)
            ]
        )
        image = torch.cat([self._image(chunk) for chunk in images.split(self.batch_size)])
        which = torch.tensor(which, device=self.device)
        return 100.0 * (image.float() * text.float()[which]).sum(-1)


def load_clip(backbone, device=None, checkpoint=None, batch_size=32):
    return CLIPReward(
        backbone, checkpoint=checkpoint or CLIP_DEFAULT, device=device, batch_size=batch_size
    )


# ----------------------------------------------------------------------------------------------
# digit: the miniatures' classifier reads their decoded pixels


def digit_of(prompt):
    """The digit a prompt asks for: its one character 0-9. ValueError in one line otherwise."""
    found = [character for character in prompt if character.isdigit()]
    if len(found) != 1:
        raise ValueError(
            f"the digit reward needs a prompt with exactly one digit 0-9, got {prompt!r}"
        )
    return int(found[0])


class DigitClassifier(nn.Module, PyTorchModelHubMixin):
    """A small CNN over 16x16 RGB digits in [0, 1]: logits (N, 10)."""

    def __init__(self, side=16, width=24):
        super().__init__()
        self.config = dict(side=side, width=width)
        self.side = side
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(2 * width * (side // 4) ** 2, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, images):
        return self.head(self.features(2.0 * images - 1.0))


class PreferenceScorer(DigitClassifier):
    """The miniatures' preference model, built as HPSv2 is (a scorer of image and prompt trained on
    pairwise preferences): the same CNN, its 10 outputs read as the score of an image for each
    prompted digit, trained with a Bradley-Terry loss by miniature.py (train_preference)."""


def model_folder(kind, folder=None):
    """Where the miniatures' `kind` ("classifier" or "preference") is: `folder`, else the shipped
    one. ValueError in one line if absent."""
    folder = folder or os.path.join(os.path.dirname(os.path.abspath(__file__)), "miniatures", kind)
    if not all(
        os.path.isfile(os.path.join(folder, name)) for name in ("config.json", "model.safetensors")
    ):
        raise ValueError(
            f"no digit {kind} in {folder}; restore miniatures/{kind} with git, retrain it with "
            f"`python miniature.py --family {kind}`, or pass --reward-checkpoint FOLDER"
        )
    return folder


def load_classifier(folder=None):
    return DigitClassifier.from_pretrained(model_folder("classifier", folder)).eval()


def load_scorer(folder=None):
    return PreferenceScorer.from_pretrained(model_folder("preference", folder)).eval()


class DigitReward:
    """log p(prompted digit | image) under the classifier of miniature.py, a black box on the
    decoded pixels as HPSv2 is on a real model's: 8-bit images, resized to the classifier's side
    (bicubic, antialiased; the miniatures already decode at its 16 px), its own normalisation. 0 is
    certainty. The classifier was trained on digits that no miniature saw (miniature.py)."""

    def __init__(self, backbone, checkpoint=None, device=None):
        self.backbone = backbone
        self.device = torch.device(device or backbone.device)
        self.model = load_classifier(checkpoint).to(self.device).requires_grad_(False)

    def pixels(self, latents):
        """The decoded 8-bit images at the models' side: (N, 3, 16, 16) in [0, 1]."""
        images = quantize(self.backbone.decode(latents)).to(self.device)
        side = self.model.side
        if images.shape[-1] != side or images.shape[-2] != side:
            images = F.interpolate(
                images, (side, side), mode="bicubic", align_corners=False, antialias=True
            )
        return images.clamp(0, 1)

    def log_probs(self, latents):
        return torch.log_softmax(self.model(self.pixels(latents)).float(), dim=1)  # (N, 10)

    @torch.no_grad()
    def details(self, latents, prompts):
        log_probs = self.log_probs(latents)
        digits = torch.tensor([digit_of(prompt) for prompt in prompts], device=log_probs.device)
        correct = (log_probs.argmax(1) == digits).float()
        return log_probs.gather(1, digits[:, None]).squeeze(1), correct

    def __call__(self, latents, prompts, noise, cond):
        return self.details(latents, prompts)[0]


class PreferenceReward(DigitReward):
    """The miniatures' quality reward, their HPSv2: the preference scorer's score of the image for
    the prompted digit (higher is preferred; real digits score highest, blurred, averaged, noisy,
    erased, wrong and unconverged ones lower). details() also gives the classifier's accuracy."""

    def __init__(self, backbone, checkpoint=None, device=None):
        super().__init__(backbone, device=device)
        self.scorer = load_scorer(checkpoint).to(self.device).requires_grad_(False)

    @torch.no_grad()
    def details(self, latents, prompts):
        images = self.pixels(latents)
        digits = torch.tensor([digit_of(prompt) for prompt in prompts], device=self.device)
        scores = self.scorer(images).float().gather(1, digits[:, None]).squeeze(1)
        correct = (self.model(images).argmax(1) == digits).float()
        return scores, correct


def load_digit(backbone, device=None, checkpoint=None):
    return DigitReward(backbone, checkpoint=checkpoint, device=device)


def load_preference(backbone, device=None, checkpoint=None):
    return PreferenceReward(backbone, checkpoint=checkpoint, device=device)


# ----------------------------------------------------------------------------------------------


def load_ocr(backbone, device=None, checkpoint=None, batch_size=8):
    import ocr  # EasyOCR needs torchvision: imported only when asked for

    return ocr.load_ocr(backbone, device=device, checkpoint=checkpoint, batch_size=batch_size)


def load_geneval(backbone, device=None, checkpoint=None, clip_checkpoint=None, batch_size=8):
    import geneval

    return geneval.load_geneval(
        backbone,
        device=device,
        checkpoint=checkpoint,
        clip_checkpoint=clip_checkpoint,
        batch_size=batch_size,
    )


REWARDS = {
    "teacher": load_teacher,
    "hpsv2": load_hpsv2,
    "clip": load_clip,
    "ocr": load_ocr,
    "geneval": load_geneval,
    "digit": load_digit,
    "preference": load_preference,
}
# rewards that read text or objects: not for the 8x8 embedded backbones
IMAGE_CONTENT = ("ocr", "geneval")
# rewards that read the miniatures' 16x16 digits: only for the mini-* backbones
DIGIT_REWARDS = ("digit", "preference")
COLUMNS = {  # what metrics() returns, per reward
    "ocr": ("ocr", "ocr edit"),
    "geneval": ("geneval", "geneval correct"),
    "digit": ("digit", "digit accuracy"),
    "preference": ("preference", "digit accuracy"),
}


def check_digits(name, backbone, spec):
    """ValueError (one line) when the reward `name` reads the miniatures' digits and the backbone
    named `backbone` (spec: its row of backbones.BACKBONES) draws none."""
    if name in DIGIT_REWARDS and "folder" not in spec:
        raise ValueError(
            f"the {name} reward reads the 16x16 handwritten digits that only the mini-* backbones "
            f"draw, not {backbone}'s images; use the teacher reward, or a mini-* backbone"
        )


def check_prompts(name, prompts):
    """ValueError (one line, naming the prompt) for a prompt the reward `name` cannot score: OCR
    needs a "quoted" target text, GenEval one of its templates."""
    if name in DIGIT_REWARDS:
        for prompt in prompts:
            digit_of(prompt)
    if name in IMAGE_CONTENT:
        from geneval import parse
        from ocr import target_text

        for prompt in prompts:
            (target_text if name == "ocr" else parse)(prompt)


@torch.no_grad()
def metrics(reward, name, latents, prompts, noise, cond):
    """name -> (N,) float tensor: the reward, and for OCR the edit score, for GenEval the binary
    correctness (GenEval's own accuracy) beside it."""
    if name == "ocr":
        rows = reward.details(latents, prompts)
        return {
            "ocr": torch.tensor([row["recall"] for row in rows]),
            "ocr edit": torch.tensor([row["edit"] for row in rows]),
        }
    if name == "geneval":
        rows = reward.details(latents, prompts)
        return {
            "geneval": torch.tensor([row["reward"] for row in rows]),
            "geneval correct": torch.tensor([float(row["correct"]) for row in rows]),
        }
    if name in DIGIT_REWARDS:
        score, correct = reward.details(latents, prompts)
        return {name: score.cpu(), "digit accuracy": correct.cpu()}
    return {name: reward(latents, prompts, noise, cond).float().cpu()}


def check_reward(name, checkpoint=None):
    """Fail fast, before a backbone is loaded: ValueError (one line) if the packages or weights of
    the reward `name` are not on this machine. Loads nothing heavy."""
    if name == "hpsv2":  # the packages and the checkpoint, both reported when both are missing
        missing = []
        for check in (_import_hps, lambda: hps_checkpoint(checkpoint=checkpoint)):
            try:
                check()
            except (ImportError, ValueError) as error:
                missing.append(str(error))
        if missing:
            raise ValueError("; ".join(missing))
    if name == "ocr":
        from ocr import check_ocr

        check_ocr(checkpoint)
    if name == "geneval":
        from geneval import CLIP_DEFAULT as GENEVAL_CLIP
        from geneval import DETECTOR_DEFAULT, check_weights

        check_weights(
            checkpoint or DETECTOR_DEFAULT, "GenEval detector", also=(GENEVAL_CLIP, "CLIP model")
        )
    if name == "digit":
        model_folder("classifier", checkpoint)
    if name == "preference":  # the scorer (its checkpoint) and the classifier behind its accuracy
        model_folder("preference", checkpoint)
        model_folder("classifier")
    if name == "clip" and not os.path.isdir(checkpoint or CLIP_DEFAULT):
        model = checkpoint or CLIP_DEFAULT
        hub_file(
            model,
            "config.json",
            f"CLIP model {model!r} not found: download it with "
            f"`hf download {model}` or pass --reward-checkpoint PATH to a local copy",
        )


def load_reward(name, backbone, device=None, checkpoint=None, **options):
    """Build the reward `name` once for `backbone`; `checkpoint` (local weights, for the rewards
    that have a model) and options go to its loader."""
    if checkpoint is not None:
        options["checkpoint"] = checkpoint
    return REWARDS[name](backbone, device=device, **options)
