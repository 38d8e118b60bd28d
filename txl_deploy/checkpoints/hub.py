"""`hf://OWNER/NAME[@REVISION]`: a model repository on the HuggingFace hub, fetched into the hub's cache (or found
there offline) and read as the HuggingFace folder its snapshot is.

Only the files a transfo-xl folder needs are fetched: `config.json`, one set of weights (`model.safetensors`, else
`pytorch_model.bin`, or the shards of either's index) and one vocabulary (`vocab.json`, `vocab.txt`, `vocab.pkl`
or `vocab.bin`); `transfo-xl-wt103` also holds TensorFlow weights of the same size, which nothing here reads.

The cache is huggingface_hub's own (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), laid out
as it lays it out: `models--OWNER--NAME/blobs/` holds the files, `snapshots/COMMIT/` links to them and `refs/main`
names the commit of the main branch. With `HF_HUB_OFFLINE=1`, or when the hub cannot be reached (a warning says so),
the snapshot the cache already holds is read. Online, the files are listed at the commit the revision names then,
and every one is downloaded at that commit, so a branch that moves meanwhile cannot mix two commits. Every link of the snapshot must resolve inside its repository's own
cache folder: a link elsewhere (a cache edited by hand, or a file planted in a shared cache) is refused before
anything is read through it.

huggingface_hub is the `hub` extra, imported only when a reference is fetched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from txl_deploy.checkpoints.huggingface import CONFIG_FILE, WEIGHT_FILES
from txl_deploy.checkpoints.vocab_files import VOCAB_FILES
from txl_deploy.errors import CheckpointError, InputError, install_hint

logger = logging.getLogger(__name__)

SCHEME = "hf://"
# The hub's rules for a repository name (huggingface_hub's validate_repo_id): letters, digits, '-', '_' and '.',
# neither first nor last a '-' or '.', at most 96 characters, no '--' or '..'.
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")
# A branch, a tag or a commit. It becomes a path in the cache (refs/REVISION), so no '..' and no leading '/'.
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}")
_TRUE = {"1", "ON", "YES", "TRUE"}  # how huggingface_hub reads a boolean environment variable

# One set of weights, in the order the HuggingFace folder reader prefers them (an index brings the shards it
# names), and one vocabulary, the first the search beside a checkpoint would find: what is fetched is what is read.


@dataclass(frozen=True)
class HubReference:
    """A parsed `hf://` reference: the repository (OWNER/NAME, or a legacy NAME) and an optional revision."""

    repo_id: str
    revision: str | None = None

    @property
    def name(self) -> str:
        """The repository's own name (what an exported file is named after)."""
        return self.repo_id.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")


def is_hub_reference(value) -> bool:
    return isinstance(value, str) and value.startswith(SCHEME)


def parse_reference(text: str) -> HubReference:
    """`hf://OWNER/NAME[@REVISION]` (or `hf://NAME`, the hub's older top-level names) -> HubReference; anything
    else -> InputError saying what a reference looks like."""
    shape = "expected hf://OWNER/NAME or hf://OWNER/NAME@REVISION, e.g. hf://transfo-xl/transfo-xl-wt103"
    if not is_hub_reference(text):
        raise InputError(f"{text!r}: not a hub reference ({shape})")
    body = text[len(SCHEME):]
    repo_id, at, revision = body.partition("@")
    parts = repo_id.split("/")
    if not repo_id or len(parts) > 2:
        raise InputError(f"{text!r}: {shape}")
    for part in parts:
        if not _NAME.fullmatch(part) or "--" in part or ".." in part or part.endswith(".git"):
            raise InputError(f"{text!r}: {part!r} is not a repository name on the hub (letters, digits, '-', '_' "
                             f"and '.', at most 96; {shape})")
    if at and (not _REVISION.fullmatch(revision) or ".." in revision or revision.endswith("/")):
        raise InputError(f"{text!r}: {revision!r} is not a branch, tag or commit ({shape})")
    return HubReference(repo_id, revision if at else None)


def fetch_snapshot(reference) -> Path:
    """The local folder holding `reference`'s files (a HubReference or its text), fetched into the hub's cache
    unless it is offline; every link in it checked to stay inside the repository's cache folder."""
    ref = reference if isinstance(reference, HubReference) else parse_reference(reference)
    hub = _import_hub()
    cache = _cache_dir(hub)
    storage = cache / ("models--" + ref.repo_id.replace("/", "--"))
    offline = _offline(hub)
    files, revision = None, ref.revision
    if not offline:
        listed = _needed_files(hub, ref)
        if listed is None:
            offline = True
        else:  # every file from the commit the listing was read at, even if the branch moves meanwhile
            files, revision = listed
    with _bars_follow_logging(hub):
        try:
            folder = hub.snapshot_download(ref.repo_id, revision=revision, cache_dir=str(cache),
                                           allow_patterns=files, local_files_only=offline, tqdm_class=FilesBar)
        except hub.utils.LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE is set" if _offline(hub) else "the hub could not be reached"
            raise CheckpointError(ref, f"not in the hub cache {cache} and {why}: fetch it once with the network "
                                       "(and HF_HUB_OFFLINE unset)") from None
        except hub.utils.RevisionNotFoundError:
            raise CheckpointError(ref, f"the hub has no revision {ref.revision!r} of {ref.repo_id}") from None
        except hub.utils.RepositoryNotFoundError:
            raise CheckpointError(ref, _not_found(ref)) from None
        except OSError as e:  # a download cut short, a full disk, a cache folder not writable
            raise CheckpointError(ref, f"could not be fetched ({_short(e)})") from None
    folder = Path(folder)
    if revision is not None and revision != ref.revision:
        _record_ref(storage, ref.revision or "main", revision)
    check_links(folder, storage)
    logger.info("%s: reading the snapshot in %s", ref, folder)
    return folder


def check_links(snapshot: Path, storage: Path) -> None:
    """Refuse a snapshot any of whose links (or itself) resolves outside `storage`, the repository's cache folder
    (models--OWNER--NAME/), or to nothing. The hub's links point into ../../blobs/; nothing else is expected."""
    inside = storage.resolve()
    entries = [snapshot]
    for parent, dirs, names in os.walk(snapshot):  # links to folders are listed in dirs, and not followed
        entries += [Path(parent) / n for n in dirs + names]
    for entry in entries:
        if entry is not snapshot and not entry.is_symlink():
            continue
        target = entry.resolve()
        if not target.is_relative_to(inside):
            raise CheckpointError(entry, f"links to {target}, outside the repository's cache folder {storage}: "
                                         "refused")
        if not target.exists():
            raise CheckpointError(entry, "links to a file the hub cache does not hold (an interrupted download: "
                                         "fetch it again)")


class FilesBar(tqdm):
    """The bar of files being fetched, shown when the project's bars are (txl_deploy/progress.py: when INFO
    messages are, on a terminal)."""

    def __init__(self, *args, **kwargs):
        if not logging.getLogger("txl_deploy").isEnabledFor(logging.INFO):
            kwargs["disable"] = True
        kwargs.setdefault("leave", False)
        super().__init__(*args, **kwargs)


def _import_hub():
    try:
        import huggingface_hub  # the hub extra: only hf:// references need it
        import huggingface_hub.constants  # the hub extra (where its cache is, whether it is offline)
        import huggingface_hub.utils  # the hub extra (its exceptions and progress-bar switches, a submodule)
    except ImportError as e:
        raise InputError(f"hf:// references need huggingface_hub: {install_hint('hub')} ({e})") from None
    return huggingface_hub


def _cache_dir(hub) -> Path:
    """The hub cache, from the environment as it is now: huggingface_hub reads it once, when first imported, and a
    long-lived process (a notebook, a test) may have changed it since."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(hub.constants.HF_HUB_CACHE)


def _offline(hub) -> bool:
    """HF_HUB_OFFLINE as it is now (see _cache_dir), or as huggingface_hub read it."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return value.upper() in _TRUE if value is not None else bool(hub.constants.HF_HUB_OFFLINE)


def _record_ref(storage: Path, revision: str, commit: str) -> None:
    """Write `refs/REVISION` = `commit`, as huggingface_hub does for a branch or tag it downloads: a download
    pinned to a commit writes none, and the cache would not know the revision offline. Written whole (a
    temporary file replaced), and only when it changes."""
    ref_path = storage / "refs" / revision
    try:
        if ref_path.is_file() and ref_path.read_text() == commit:
            return
        ref_path.parent.mkdir(parents=True, exist_ok=True)
        part = ref_path.with_name(ref_path.name + ".part")
        part.write_text(commit)  # no newline, as the hub writes it
        os.replace(part, ref_path)
    except OSError as e:  # a shared cache this user cannot write: the files were fetched all the same
        logger.warning("%s: could not record %s as commit %s in the hub cache (%s)", storage.name, revision,
                       commit, _short(e))


def _needed_files(hub, ref: HubReference) -> tuple[list[str], str | None] | None:
    """The files of the repository a transfo-xl folder needs, from its listing on the hub, and the commit the
    listing is of; None when the hub cannot be reached (the cache is read instead, with a warning)."""
    try:
        info = hub.HfApi(library_name="txl-deploy").model_info(ref.repo_id, revision=ref.revision)
    except hub.utils.RevisionNotFoundError:
        raise CheckpointError(ref, f"the hub has no revision {ref.revision!r} of {ref.repo_id}") from None
    except hub.utils.RepositoryNotFoundError:  # also a gated repository, and a private one without a token
        raise CheckpointError(ref, _not_found(ref)) from None
    except OSError as e:  # no connection, a timeout, the hub down (requests' errors are OSErrors)
        logger.warning("%s: the hub could not be reached (%s); reading the hub cache", ref, _short(e))
        return None
    names = {s.rfilename for s in info.siblings or ()}
    if CONFIG_FILE not in names:
        raise CheckpointError(ref, f"has no {CONFIG_FILE}: not a HuggingFace transfo-xl model repository")
    files = [CONFIG_FILE]
    for weights in WEIGHT_FILES:
        if weights in names:
            files.append(weights)
            break
        if f"{weights}.index.json" in names:
            stem, suffix = weights.rsplit(".", 1)
            shard = re.compile(re.escape(stem) + r"-\d+-of-\d+\." + re.escape(suffix))
            files += [f"{weights}.index.json", *sorted(n for n in names if shard.fullmatch(n))]
            break
    else:
        raise CheckpointError(ref, f"has no PyTorch weights ({' or '.join(WEIGHT_FILES)}, or a shard index)")
    files += [name for name in VOCAB_FILES if name in names][:1]
    logger.info("%s: fetching %s (commit %s)", ref, ", ".join(files), info.sha)
    return files, info.sha or ref.revision


@contextlib.contextmanager
def _bars_follow_logging(hub):
    """The hub's per-file download bars hidden as the project's bars are (-q), and put back as they were."""
    hide = not logging.getLogger("txl_deploy").isEnabledFor(logging.INFO)
    was_disabled = hub.utils.are_progress_bars_disabled()
    if hide and not was_disabled:
        hub.utils.disable_progress_bars()
    try:
        yield
    finally:
        if hide and not was_disabled:
            hub.utils.enable_progress_bars()


def _not_found(ref: HubReference) -> str:
    return (f"the hub has no model repository {ref.repo_id} (or it is private or gated: log in with "
            "`hf auth login` or set HF_TOKEN)")


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
