"""
Which sections of docs/RESULTS.md still match the code that measured them, and the claims table
that opens the page.

    python -m evidence.stale           # the check: fails on a section stale and not kept
    python -m evidence.stale --write   # first writes the claims table and the headings

SECTIONS declares, per section, the heading it stands under and the files its numbers depend on
(not the code that writes sections). A section is stale where one of those files differs between
the commit it ran at and HEAD (`git diff --quiet <commit> HEAD -- <files>`), or where it ran with
uncommitted changes. KEPT stands a stale section, with the reason it still holds; TO_RERUN lists
one still to rerun, shown as stale (here and in the claims table) without failing the check. The
check also fails where the page is not laid out as the sections give it now (its claims table
first, then the sections under their headings), so the page never calls a section current that is
not. Without the repository's history it fails: a
section's commit must be found to be compared.
"""

import argparse
import os
import re
import subprocess
import sys

from evidence.results import (
    HEADER,
    REPOSITORY,
    RESULTS,
    one_line_errors,
    sections,
    write_lines_atomic,
)

DIGIT_MINIATURES = ("miniatures/mini-sd3", "miniatures/mini-flux", "miniatures/mini-sdxl")
# what a held-out sample and its scores depend on: the loop, the models, the rewards, the prompts
SAMPLING = ("rollout.py", "evaluate.py", "backbones", "rewards", "prompts", "miniatures/data.py")
SAMPLING += ("miniatures/realism.py", "miniatures/preference", "miniatures/classifier")
# and a trained policy's: the method and the studies' training runs
TRAINING = SAMPLING + ("train.py", "policy.py", "baselines.py", "evidence/results.py")

MIX = SAMPLING + ("miniatures/mini-mix", "miniatures/mix-classifier", "miniatures/mix.py")
MIX += ("evidence/mix.py", "evidence/miniatures.py")
SCHNELL = ("miniatures/mini-flux-schnell",)
BOUND = ("toy_js.py", "baselines.py", "evidence/bound.py")
REGIME = TRAINING + BOUND + ("miniatures/mini-sd3", "evidence/regime_study.py")
REGIME += ("evidence/baseline_study.py",)
ABLATION = TRAINING + DIGIT_MINIATURES + ("evidence/ablation.py",)
INSTANCE = ABLATION + ("evidence/instance_study.py",)
COMPARATOR = ("evidence/comparator_study.py",)
BENCH = TRAINING + DIGIT_MINIATURES + ("comparator", "miniatures/layouts.py", "sample.py")

# section -> (the heading it stands under, the files its numbers depend on)
SECTIONS = {
    "miniatures": ("The method", ABLATION),
    "distilled": ("The method", ABLATION + SCHNELL),
    "baselines": ("The baselines", TRAINING + DIGIT_MINIATURES + ("evidence/baseline_study.py",)),
    "regime": ("The baselines", REGIME),
    "tie": ("The baselines", REGIME + ("evidence/tie_study.py",)),
    "tie-confirm": ("The baselines", REGIME + ("evidence/tie_study.py", "evidence/tie_confirm.py")),
    "toy_js": ("The baselines", ("toy_js.py", "baselines.py", "evidence/toy_js.py")),
    "bound": ("The baselines", BOUND),
    "embedded digits-prompt digits-noise": ("Instance-level", TRAINING + ("evidence/ablation.py",)),
    "instance": ("Instance-level", INSTANCE),
    "ceiling": ("Instance-level", INSTANCE + ("evidence/ceiling.py",)),
    "comparator": ("The comparator", TRAINING + DIGIT_MINIATURES + ("comparator",) + COMPARATOR),
    "guidance": ("The miniatures", SAMPLING + DIGIT_MINIATURES + ("evidence/miniatures.py",)),
    "agreement": ("The miniatures", SAMPLING + DIGIT_MINIATURES + ("evidence/miniatures.py",)),
    "check": (
        "The miniatures",
        SAMPLING + DIGIT_MINIATURES + SCHNELL + ("evidence/miniatures.py",),
    ),
    "mini-mix gates": ("The miniatures", MIX),
    "mini-mix gates, guidance by the gates' thresholds": ("The miniatures", MIX),
    "bench all on cpu": ("Cost", BENCH + ("evidence/bench.py",)),
    "bench policy on cpu": ("Cost", ("policy.py", "comparator", "evidence/bench.py")),
}

# section -> why it stands though a file it depends on changed since it ran
KEPT = {
    "tie": "the exploratory record that tie-confirm's plan cites, its numbers those of its commit",
    "mini-mix gates, guidance by the gates' thresholds": (
        "the record of the first guidance rule, replaced at edfac171a254 (README discloses it)"
    ),
}
# section -> what its rerun takes (its command heads the section), or what was measured meanwhile
TO_RERUN = {
    "distilled": "trains mini-flux and mini-flux-schnell at L = 2 to 5 over 3 seeds",
    "embedded digits-prompt digits-noise": "trains 6 rows x 3 seeds on each backbone",
    "instance": "its oracles and predictors took 207 min of one thread",
    "ceiling": "87 min on 2 cores",
    "guidance": "50-step samples of 512 contexts at 10 guidances per miniature",
}

# One row per claim and place measured: (the claim, whose, where it was measured, the section,
# its headline line's first characters, the column of that table row or a pattern the line
# matches, which of the lines so starting (0: the first)). The claims table cites it.
INTERVAL = r"[-+]?\d[\d.]* ± [\d.]+"
CLAIMS = [
    ("A schedule learned with JS beats the default at few steps", "paper",
     "mini-sd3, L = 3, seed 0: held-out gain", "miniatures",
     "- `python train.py --backbone mini-sd3 --seed 0`", INTERVAL, 0),
    ("JS beats cross-context RLOO", "paper", "mini-sd3, L = 2, default start, 5 seeds",
     "baselines", "| js - xctx (reward, paired) |", "mini-sd3 L=2", 1),
    ("JS beats RLOO", "paper", "mini-sd3, L = 2, flat start, 5 seeds", "baselines",
     "| js - rloo (reward, paired) |", "mini-sd3 L=2", 0),
    ("JS beats RLOO", "paper", "mini-sd3 at the tie, B = 4, 148 fresh seeds: area", "tie-confirm",
     "- JS - rloo: area", INTERVAL, 0),
    ("JS beats cross-context RLOO", "paper", "mini-sd3 at the tie, B = 4, 148 fresh seeds: area",
     "tie-confirm", "- JS - xctx: area", INTERVAL, 0),
    ("JS's estimate of each context's mean has lower MSE than RLOO's", "paper",
     "simulated rewards: cells where JS is below RLOO", "toy_js", "- JS below RLOO in",
     r"\d+ of \d+ cells", 0),
    ("A schedule per context beats one for all", "paper",
     "digits-prompt, L = 4: share of the per-class oracle's gap, 3 seeds",
     "embedded digits-prompt digits-noise", "| learned instance, js |", "gap captured (spread)", 0),
    ("A schedule per context beats one for all", "paper",
     "mini-sd3, L = 3: learned global - instance averaged", "miniatures",
     "- mini-sd3, L = 3: learned global", INTERVAL, 0),
    ("TPDM-style PPO trails the single-pass policy", "paper",
     "mini-sd3, L = 3: step-wise PPO - single-pass", "comparator",
     "| step-wise, PPO with TPDM's settings", "minus single-pass (paired by seed)", 1),
    ("A learned schedule nears the distilled model", "paper",
     "L = 2: learned mini-flux - mini-flux-schnell's default", "distilled",
     "- L = 2, preference reward per context", INTERVAL, 0),
    ("JS leads RLOO where contexts are alike", "project",
     "mini-sd3, one digit, B = 4, 15 seeds: endpoint", "regime", "| js |",
     "- RLOO, endpoint (paired)", 0),
    ("The bound's closed forms match simulation", "project", "24 simulated cells", "bound",
     "- closed forms against 24 simulated cells", r"largest \|z\| = [\d.]+", 0),
    ("The preference reward ranks step counts as the Frechet distance does", "project",
     "mini-sd3, 6 step counts: rank correlation", "agreement", "- mini-sd3: rank correlation",
     r"preference reward [-\d.]+", 0),
    ("An instance policy trained on the reward gains on the miniatures", "project",
     "mini-sd3, mini-flux, mini-sdxl, L = 3", "ceiling", "Verdict:", r"(?<=Verdict: )[^:]*", 0),
    ("mini-mix follows its prompts' kinds and classes", "project",
     "200 held-out contexts per kind", "mini-mix gates", "Gates:", r"(?<=Gates: )[^.]*", 0),
    ("The policy costs little beside the model", "project",
     "mini-sd3: a training iteration against its model calls", "bench all on cpu",
     "mini-sd3 training iteration", r"[\d.]+x$", 0),
]  # fmt: skip

HEADINGS = ["The method", "The baselines", "Instance-level", "The comparator", "The miniatures"]
HEADINGS += ["Cost"]
CLAIMS_TITLE = "## Claims"
CLAIMS_NOTE = (
    "Each claim (the paper's, or this project's) with the headline its section measured. Status: "
    "current where no file the section's numbers depend on changed since its commit, kept where "
    "evidence/stale.py gives the reason it still stands, stale where it waits for its command to "
    "run again. `python -m evidence.stale` checks this table; `--write` rewrites it."
)


def git(*args):
    done = subprocess.run(["git", *args], cwd=REPOSITORY, capture_output=True, text=True)
    return done.returncode, done.stdout.strip()


def ran_at(lines):
    """The commit a section names ("at commit <hex>[ with uncommitted changes]")."""
    return next(line[len("at commit ") :] for line in lines if line.startswith("at commit "))


def status(name, lines):
    """Against HEAD: 'current', 'kept: <why>', 'stale, to rerun: <why>' or 'stale: <why>'."""
    at = ran_at(lines)
    if name not in SECTIONS:
        raise ValueError(
            f"section {name!r} of docs/RESULTS.md is not declared in evidence/stale.py"
        )
    if at.endswith(" with uncommitted changes"):
        why = "ran with uncommitted changes"
    else:
        code, _ = git("cat-file", "-e", f"{at}^{{commit}}")
        if code != 0:
            raise ValueError(
                f"section {name!r}: its commit {at} is not in this repository's history"
            )
        _, changed = git("diff", "--name-only", at, "HEAD", "--", *SECTIONS[name][1])
        if not changed:
            return "current"
        why = "changed since: " + ", ".join(changed.splitlines()[:3])
    if name in KEPT:
        return f"kept: {KEPT[name]}"
    return f"stale, to rerun: {TO_RERUN[name]}; {why}" if name in TO_RERUN else f"stale: {why}"


def headline(lines, row, column, occurrence):
    """What a claim cites from the `occurrence`-th line starting with `row`: a table row's cell
    under the header `column`, or on any other line the first match of the pattern `column`."""
    found = [i for i, line in enumerate(lines) if line.startswith(row)][occurrence]
    if not row.startswith("|"):
        return re.search(column, lines[found]).group(0)
    header = next(lines[i] for i in range(found, -1, -1) if column in lines[i])
    cells = [cell.strip() for cell in lines[found].strip("|").split("|")]
    return cells[[cell.strip() for cell in header.strip("|").split("|")].index(column)]


def claims_table(found, states):
    """The claims table's lines, from the sections `found` (name -> lines) and their `states`
    (name -> status())."""
    lines = [
        CLAIMS_TITLE,
        "",
        CLAIMS_NOTE,
        "",
        "| claim | whose | measured on | result | section | commit | status |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for claim, whose, where, name, row, column, occurrence in CLAIMS:
        if name not in found:
            continue
        number = headline(found[name], row, column, occurrence).replace("|", "\\|")
        state = states[name].split(":")[0]
        at = ran_at(found[name])[:12]
        lines.append(f"| {claim} | {whose} | {where} | {number} | {name} | {at} | {state} |")
    return lines


def page(found, states):
    """The page's body below its header: the claims table, then each heading's sections."""
    body = [*claims_table(found, states), ""]
    for heading in [*HEADINGS, None]:  # None: sections not declared yet, last
        names = [name for name in found if SECTIONS.get(name, (None,))[0] == heading]
        body += [f"## {heading}", ""] if heading and names else []
        for name in names:
            body += [f"<!-- section: {name} -->", *found[name], f"<!-- end: {name} -->", ""]
    return body


def rendered(found, states):
    """docs/RESULTS.md's text from its sections (name -> lines): the header, the claims table, then
    the sections under their headings."""
    return "\n".join([*HEADER, "", *page(found, states)]).rstrip("\n") + "\n"


def main(write):
    if not os.path.exists(os.path.join(REPOSITORY, ".git")):
        raise ValueError("evidence.stale needs the repository's git history (a clone, not a copy)")
    text = open(RESULTS).read()
    found = sections(text)
    states = {name: status(name, lines) for name, lines in found.items()}  # git, once each
    if write:
        text = rendered(found, states)
        write_lines_atomic(RESULTS, [text])
    failures = []
    for name, state in states.items():
        print(f"{name}: {state}")
        if state.startswith("stale:"):
            failures.append(name)
        if state == "current" and (name in KEPT or name in TO_RERUN):
            failures.append(f"{name} (current: its entry in KEPT or TO_RERUN is not needed)")
    if text != rendered(found, states):
        failures.append("the claims table or the headings (python -m evidence.stale --write)")
    if failures:
        sys.exit("error: stale and not kept: " + "; ".join(failures))
    print(f"{len(found)} sections: none stale that is not kept or listed to rerun")


parser = argparse.ArgumentParser("python -m evidence.stale", description=__doc__.split("\n")[1])
parser.add_argument("--write", action="store_true", help="first write the claims and headings")

if __name__ == "__main__":
    with one_line_errors():
        main(parser.parse_args().write)
