"""
A file of a Hugging Face Hub repository (a backbone's weights, a reward model, a prompt set, a
trained policy): from the local cache, else downloaded, else one line that says how to get it.
"""

import socket
import urllib.parse


def hub_file(repo, filename, missing, repo_type=None):
    """A file of a hub repository from the local cache, else downloaded. When it is neither cached
    nor reachable: ValueError(`missing` + why) at once, not after the hub client's retries."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo, filename, repo_type=repo_type)
    except ValueError:  # not a repository id at all: a local path that does not exist, say
        raise ValueError(f"{missing} (no such folder, and not a hub repository id)") from None
    if isinstance(cached, str):
        return cached
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname
    try:
        if constants.HF_HUB_OFFLINE:
            raise OSError("HF_HUB_OFFLINE is set")
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as error:
        raise ValueError(
            f"{missing} (not in the local cache, and {host} is unreachable: {error})"
        ) from None
    try:
        return hf_hub_download(repo, filename, repo_type=repo_type)
    except Exception as error:  # gated, missing or refused: all mean "not available"
        raise ValueError(f"{missing} ({type(error).__name__})") from None
