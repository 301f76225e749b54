"""Every file, folder and `module.name` that the prose names exists: README.md, docs/*.md (of
docs/RESULTS.md the header and each section's command: the rest is what the commands wrote), the
docstrings and comments of every tracked .py file outside tests/, and the policy's model card.
Dotted names are resolved with ast, never imported. Nothing refers to files outside the repository.
"""

import ast
import fnmatch
import glob
import io
import os
import re
import subprocess
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Names in the prose that are no file here, on purpose (fnmatch patterns). Hub ids (xswu/HPSv2),
# URLs and paths like data/HPDv2 or /models/sdxl are not taken for references at all: a slash path
# is one only if it starts with a folder of the repository or ends in a file extension or in /.
ALLOWED = (
    # outputs, never tracked: what the commands write in a run folder or --out-dir (OUT_DIR)
    "out/* out_dir/* OUT_DIR/* samples/ eval/ policy/ ckpt.pt metrics.jsonl eval.json grid.png"
    " schedule.json schedules.json schedules.png scores.json results.md *_default.png"
    " *_learned.png *_teacher.png oracles.json tuning.json toy_js.png prediction-*.json pairs.json"
    " trajectories.json"
    # files on the Hub: HPSv2's weights, HPDv2's prompts, the files of a diffusers model folder
    " HPS_v2*.pt train.json benchmark/* config.json model.safetensors scheduler_config.json"
    " transformer/config.json"
    # TPDM's code (github.com/maple-research-lab/TPDM), which docs/COMPARATOR.md follows
    " scripts/launch_sd3_train.sh launch_sd3_train.sh src/train/rloo_trainer.py rloo_trainer.py"
    " src/models/stable_diffusion_3/* modeling_sd3_pnt.py"
    # the code of GenEval, hpsv2 and open_clip that rewards/ reproduces
    " prompts/create_prompts.py create_prompts.py object_names.txt evaluation/*.py"
    " evaluation_metadata.jsonl evaluate_images.py hpsv2/src/open_clip/*.py open_clip/constants.py"
).split()
OUTSIDE = ("PAPER.md", "STYLE.md", "ENV-NOTES.md", "../shared")  # notes beyond the repository

EXTENSIONS = "py|md|txt|json|jsonl|png|pt|sh|toml|ini|safetensors|lock|log"
# a run of path or name characters, not part of a longer one, nor $VARIABLE/..., nor math: K/(K-1)
TOKEN = re.compile(r"(?<![\w/.$<>:-])(?:\.\./)*\w[\w.<>*+-]*(?:/[\w.<>*+-]*)*(?![\w/])(?!(?<=/)\()")
FILE = re.compile(rf".*\.({EXTENSIONS})$")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.split()


def tracked():  # the files of the working tree that git tracks
    return [path for path in git("ls-files") if os.path.isfile(os.path.join(ROOT, path))]


def module_names():
    """What a dotted reference may start with: every module and package name in the tree or in
    its history, so that a reference to a module that moved or went is still checked."""
    paths = tracked() + git("log", "--name-only", "--format=")
    parts = [part for path in paths if path.endswith(".py") for part in path[:-3].split("/")]
    return set(parts) - {"__init__"}


def references(text, modules):
    """(kind, name) of every file path (kind "file") and dotted name ("name") in `text`."""
    found = []
    for token in TOKEN.findall(text):
        token = token.rstrip(".").split("#")[0]
        head = token.split("/")[0]
        if FILE.match(token) or token.endswith("/"):
            found.append(("file", token))
        elif "/" in token and DOTTED.match(token.rsplit("/", 1)[1]):  # comparator/tpdm.TPDM
            found.append(("name", token.replace("/", ".")))
        elif "/" in token and os.path.isdir(os.path.join(ROOT, head)):
            found.append(("file", token))
        elif DOTTED.match(token) and head.split(".")[0] in modules:
            found.append(("name", token))
    return found


def top_level(path):
    """The names a module defines, assigns or imports at its top level."""
    names = set()
    for node in ast.parse(open(path).read()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)} | {getattr(node, "name", "")}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolves(name, folder):
    """`a.b.c`: a module a/b.py or a/b/__init__.py (from the root or from `folder`) defines c at
    its top level, or a.b.c is a module itself; what follows c is not checked."""
    parts = name.split(".")
    for base in {ROOT, os.path.join(ROOT, folder)}:
        for cut in range(len(parts), 0, -1):
            stem = os.path.join(base, *parts[:cut])
            path = next((p for p in (stem + ".py", stem + "/__init__.py") if os.path.isfile(p)), "")
            if path or (cut == len(parts) and os.path.isdir(stem)):
                if cut == len(parts) or parts[cut] in top_level(path):
                    return True
                break
    return False


def exists(kind, name, path):
    """Whether `name`, named in the file `path`, exists (or is allowed)."""
    if kind == "name":
        return resolves(name, os.path.dirname(path))
    if any(fnmatch.fnmatchcase(name, allowed) for allowed in ALLOWED):
        return True
    pattern = re.sub(r"<\w+>", "*", name)  # docs/baselines-<miniature>.png: any miniature's
    return any(glob.glob(os.path.join(ROOT, base, pattern)) for base in ("", os.path.dirname(path)))


def prose_of_python(source):
    """The docstrings and comments of a module, and its model card if it has one."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts.append(ast.get_docstring(node) or "")
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MODEL_CARD":
            texts.append(node.value.value)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return texts + [token.string for token in tokens if token.type == tokenize.COMMENT]


def prose():
    """(path, text) of every piece of prose the references are read from."""
    for path in tracked():
        if path == "docs/RESULTS.md":  # its header, and the command under each section marker
            lines = open(os.path.join(ROOT, path)).read().splitlines()
            marks = [i for i, line in enumerate(lines) if line.startswith("<!-- section")]
            yield path, "\n".join(lines[: marks[0]] + [lines[i + 2] for i in marks])
        elif path == "README.md" or (path.startswith("docs/") and path.endswith(".md")):
            yield path, open(os.path.join(ROOT, path)).read()
        elif path.endswith(".py") and not path.startswith("tests/"):
            yield path, "\n".join(prose_of_python(open(os.path.join(ROOT, path)).read()))


def stale(texts, modules):
    found = [(path, kind, name) for path, text in texts for kind, name in references(text, modules)]
    return [f"{path}: {name}" for path, kind, name in found if not exists(kind, name, path)]


def test_the_extractor_flags_a_stale_reference_and_passes_a_good_one():
    text = "Run `python -m evidence.ablation` (docs/BOUND.md, rollout.run_schedule, a = s2/(K-1)); "
    text += "miniature.py and baselines.no_such_function are gone; out/x/ckpt.pt is written."
    found = stale([("README.md", text)], {"evidence", "rollout", "baselines"})
    assert found == ["README.md: miniature.py", "README.md: baselines.no_such_function"]


def test_every_reference_in_the_prose_exists():
    assert stale(prose(), module_names()) == []


def test_nothing_refers_to_files_outside_the_repository():
    hits = []
    for path in tracked():
        if path != "tests/test_references.py":
            data = open(os.path.join(ROOT, path), "rb").read()
            hits += [f"{path}: {name}" for name in OUTSIDE if name.encode() in data]
    assert hits == []
