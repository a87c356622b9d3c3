"""`llmd pull`: one GGUF file from the Hugging Face Hub into llmd's cache, checked against its sha256.

The only command that reaches the network. huggingface_hub's `hf_hub_download` fetches the file at the
commit the name resolves to (one HEAD first: the commit, the size and the sha256 the Hub reports),
with its progress bar; a connection dropped mid-file is resumed from the bytes already written (an
HTTP Range request). The download lands in ``<cache>/.pulling/<slug>/``; only once its sha256 matches
is it moved to ``<cache>/<slug>/`` with its record (llmd.runtime.model_names), so a name never
resolves to an unchecked file. A wrong sha256 removes the download. ``HF_ENDPOINT`` (a mirror) and
``HF_TOKEN`` (gated repositories) are huggingface_hub's own variables.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from llmd.model_catalog import CatalogEntry
from llmd.runtime.errors import LLMDError
from llmd.runtime.formats.gguf_check import is_gguf_file
from llmd.runtime.formats.gguf_import import file_sha256
from llmd.runtime.model_names import PulledModel, models_dir, read_record, slug, write_record

_SHA256 = re.compile(r"[0-9a-f]{64}")


class PullError(LLMDError):
    """A pull failed: not found, unreachable, or not the bytes it should be. Says what to do."""


def pull(entry: CatalogEntry, progress: bool = True) -> PulledModel:
    """The model ``entry`` names in llmd's cache, downloaded unless it is there with the same sha256."""
    endpoint = os.environ.get("HF_ENDPOINT") or None
    meta = _hub_call(entry, lambda: _metadata(entry, endpoint))
    expected = entry.sha256 or hub_sha256(meta.etag)
    if expected is None:
        raise PullError(f"{entry.repo}/{entry.file}: no sha256 is pinned and the Hub reports none for the file; "
                        "pass --sha256 HEX to check it")
    folder = models_dir() / slug(entry.name)
    have = read_record(folder)
    if have is not None and have.sha256 == expected:
        return have
    staging = models_dir() / ".pulling" / slug(entry.name)
    path = Path(_hub_call(entry, lambda: _download(entry, meta.commit_hash, staging, endpoint, progress)))
    got = file_sha256(path, progress)
    if got != expected or not is_gguf_file(path):
        shutil.rmtree(staging, ignore_errors=True)
        what = f"sha256 {got}, not the expected {expected}" if got != expected else "not a GGUF file"
        raise PullError(f"{entry.repo}/{entry.file}: the download has {what}; it was removed. Pull again (a "
                        "download changed in transit fails this way), or check the pin (--sha256)")
    model = PulledModel(entry.name, entry.repo, entry.file, meta.commit_hash or entry.revision, got,
                        path.stat().st_size)
    return install(path, folder, model, staging)


def _metadata(entry: CatalogEntry, endpoint: Optional[str]):
    """One HEAD: the commit the revision resolves to, the size, and the Hub's sha256 (as the ETag)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url   # the network, for this command only
    url = hf_hub_url(entry.repo, entry.file, revision=entry.revision, endpoint=endpoint)
    return get_hf_file_metadata(url, endpoint=endpoint)


def _download(entry: CatalogEntry, commit: Optional[str], staging: Path, endpoint: Optional[str],
              progress: bool) -> str:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars
    if not progress:
        disable_progress_bars()
    return hf_hub_download(entry.repo, entry.file, revision=commit or entry.revision, local_dir=staging,
                           endpoint=endpoint)


def install(path: Path, folder: Path, model: PulledModel, staging: Path) -> PulledModel:
    """Move a checked download into its folder of llmd's cache (replacing an older pull of the name)."""
    shutil.rmtree(folder, ignore_errors=True)
    dest = folder / model.file
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, dest)
    write_record(folder, model)
    shutil.rmtree(staging, ignore_errors=True)
    return read_record(folder)


def hub_sha256(etag: Optional[str]) -> Optional[str]:
    """The sha256 the Hub reports for a large file (its LFS object id, sent as the ETag), else None."""
    return etag if etag and _SHA256.fullmatch(etag) else None


def _hub_call(entry: CatalogEntry, call):
    """``call()``, with huggingface_hub's failures as a PullError that says what to do."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    where = f"{entry.repo}/{entry.file}@{entry.revision}"
    try:
        return call()
    except OfflineModeIsEnabled:
        raise PullError(f"{where}: HF_HUB_OFFLINE is set; unset it to let `llmd pull` download") from None
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            raise PullError(f"{where}: the Hub refused access ({status}); the repository may be gated or private: "
                            "accept its terms on the Hub and set HF_TOKEN") from None
        if status == 404:
            raise PullError(f"{where}: not found on the Hub (404); check the repository, file and revision "
                            "(`llmd pull --list` shows the names llmd knows)") from None
        raise PullError(f"{where}: the Hub answered {status or e}; try again later") from None
    except (httpx2.TransportError, OSError) as e:
        endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        raise PullError(f"{where}: cannot download from {endpoint} ({e}); check the network (a pull resumes "
                        "where a dropped connection left off), or set HF_ENDPOINT to a mirror") from None
