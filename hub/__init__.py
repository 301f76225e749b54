"""
Files in the Hugging Face Hub's formats, wherever a model comes from (a backbone's weights, a
reward model, a prompt set, a trained policy): a file of a Hub repository from the local cache,
else downloaded, else one line that says how to get it; a JSON or safetensors file checked whole
before anything loads it.
"""

import json
import os

# this checkout's root: the shipped miniatures, reward models and prompt sets are found from it
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hub_file(repo, filename, missing, repo_type=None):
    """A file of a hub repository from the local cache, else downloaded. When it is neither cached
    nor reachable: ValueError(`missing` + why) at once. The metadata request is made without
    retries (huggingface_hub's fast fallback), not after hf_hub_download's five."""
    from huggingface_hub import (
        get_hf_file_metadata,
        hf_hub_download,
        hf_hub_url,
        try_to_load_from_cache,
    )

    try:
        cached = try_to_load_from_cache(repo, filename, repo_type=repo_type)
    except ValueError:  # not a repository id at all: a local path that does not exist, say
        raise ValueError(f"{missing} (no such folder, and not a hub repository id)") from None
    if isinstance(cached, str):
        return cached
    try:
        get_hf_file_metadata(hf_hub_url(repo, filename, repo_type=repo_type))
        return hf_hub_download(repo, filename, repo_type=repo_type)
    except Exception as error:  # offline, unreachable, gated, missing: all mean "not available"
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{missing} (not in the local cache: {reason})") from None


def read_json(path, advice):
    """A JSON file's content; ValueError in one line naming the file if it is not JSON."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is damaged (not JSON: {type(error).__name__}); {advice}"
        ) from None


def check_safetensors(path, advice):
    """ValueError in one line unless `path` is a whole safetensors file, as safetensors itself
    opens it: the header parses and the tensors' data fills the file (a truncated or random file
    fails). Reads the header only, so it is cheap for a model of any size."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except (SafetensorError, OSError) as error:
        reason = str(error).splitlines()[0]
        raise ValueError(f"{path} is damaged or truncated ({reason}); {advice}") from None
