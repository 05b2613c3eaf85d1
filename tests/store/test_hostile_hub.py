"""`llamaterm pull` against a hostile Hub (tests/support/hub_server.py with its hostile knobs): file names that leave
the store, commit ids that are paths, odd revisions, a repo that changes between the listing and the downloads, and
more bytes than listed. Each pull fails with one line; nothing is written outside the store and nothing partial is
visible in it."""

from pathlib import Path

import pytest

from llamaterm.engine.store import hub
from llamaterm.engine.store.model_store import MANIFEST
from tests.support.hub_store import assert_store_empty, assert_user_error, home, llamaterm, ls, stored
from tests.support.safetensors_files import write_dense

pytestmark = pytest.mark.slow  # `llamaterm pull` in subprocesses

REPO = "tester/Tiny-Llama-GGUF"


def files_outside_the_store(root: Path) -> list[Path]:
    """Every file under the test's tmp_path that is not in the store's own folders."""
    store = home()
    return [p for p in root.rglob("*") if p.is_file() and store not in p.parents]


@pytest.mark.parametrize(
    "name",
    [
        "{outside}/evil.gguf",  # an absolute name: was written there, exit 0
        "../../../outside/evil.gguf",  # left a folder and a .part outside the store
        "Q4_0/../../../outside/evil.gguf",
        "..\\..\\outside\\evil.gguf",  # a separator on Windows
        "C:evil.gguf",
    ],
)
def test_file_names_that_leave_the_store_are_refused(hub_server, models, tmp_path, name):
    name = name.format(outside=tmp_path / "outside")
    hub_server.add_repo(REPO, {name: models["Q4_0"], "README.md": b"# Tiny\n"})
    before = files_outside_the_store(tmp_path)
    r = llamaterm("pull", REPO)
    assert_user_error(r, "not a safe file name", "refusing to pull")
    assert files_outside_the_store(tmp_path) == before
    assert not (tmp_path / "outside").exists()
    assert_store_empty()
    assert [m for m, p, _ in hub_server.requests if "/resolve/" in p] == []  # refused before any download


@pytest.mark.parametrize("commit", ["../../../outside", "a" * 39 + "/", "main", " "])
def test_a_commit_id_that_is_not_a_sha_is_refused(hub_server, models, tmp_path, commit):
    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": models["Q4_0"]})
    hub_server.commit_override = commit
    r = llamaterm("pull", REPO)
    assert_user_error(r, "not a git commit id")
    assert not (tmp_path / "outside").exists()
    assert_store_empty()


@pytest.mark.parametrize("revision", ["../../../outside", "main/../../x", "v1\\..\\x", "\u00e9t\u00e9", "a" * 300])
def test_odd_revisions_stay_inside_the_store(hub_server, models, tmp_path, revision):
    """A revision only goes into URLs (quoted); the commit the Hub answers names the staging folder. So an odd
    revision is a one-line error or, where the server makes sense of it, a whole model in the store."""
    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": models["Q4_0"]})
    before = files_outside_the_store(tmp_path)
    r = llamaterm("pull", REPO, "--revision", revision)
    if r.returncode:
        assert_user_error(r)
        assert_store_empty()
    else:
        assert (home() / r.stdout.strip() / "Tiny-Llama-Q4_0.gguf").read_bytes() == models["Q4_0"]
    assert files_outside_the_store(tmp_path) == before


def test_a_repo_that_changes_after_its_listing(hub_server, models):
    """The listing promises one file; the commit then serves other bytes under that name. The stored copy of
    the first pull stays whole and nothing of the second becomes visible."""
    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": models["Q4_0"]})
    assert llamaterm("pull", REPO).returncode == 0
    first = stored("tiny-llama-q4_0")

    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": models["Q8_0"]})  # a new commit ...

    def swap(repo_id):  # ... whose file changes (same size, other bytes) once it has been listed
        repo = hub_server.repos[repo_id]
        changed = bytearray(models["Q8_0"])
        changed[-1] ^= 0xFF
        repo.commits[repo.branches["main"]] = {"Tiny-Llama-Q4_0.gguf": bytes(changed)}

    hub_server.after_info = swap
    r = llamaterm("pull", REPO)
    assert_user_error(r, "is corrupt", "pull again")
    assert stored("tiny-llama-q4_0") == first
    assert [m["name"] for m in ls()] == ["tiny-llama-q4_0"]
    assert (home() / "tiny-llama-q4_0" / "Tiny-Llama-Q4_0.gguf").read_bytes() == models["Q4_0"]


def test_more_bytes_than_listed_are_not_written(hub_server, models):
    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": models["Q4_0"]})
    hub_server.extra_bytes = 10_000_000  # an endless stream, as far as the client can tell
    r = llamaterm("pull", REPO)
    assert_user_error(r, "more of Tiny-Llama-Q4_0.gguf than the")
    assert_store_empty()
    kept = [p for p in (home() / ".partial").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in kept) <= len(models["Q4_0"])


def test_a_download_that_is_no_checkpoint_is_not_kept(hub_server, models):
    """The hub's bytes are verified, so downloading them again gives the same: a pull whose files llamaterm cannot
    read says so and keeps nothing (the files stayed in .partial, where neither ls nor rm saw them)."""
    damaged = models["Q4_0"][:24] + b"\xff" * (len(models["Q4_0"]) - 24)  # the header, then noise
    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": damaged})
    assert_user_error(llamaterm("pull", REPO), "holds no checkpoint llamaterm can read")
    assert_store_empty()
    assert not [p for p in (home() / ".partial").rglob("*") if p.is_file()]


def test_the_path_check_is_the_pull_s_own(hub_server, models, tmp_path):
    """In-process: the same refusal comes from engine.hub.pull, as the TUI or a script would call it."""
    hub_server.add_repo(REPO, {f"{tmp_path}/evil.gguf": models["Q4_0"]})
    with pytest.raises(hub.PullError, match="not a safe file name"):
        hub.pull(REPO)
    assert not (tmp_path / "evil.gguf").exists()
    assert not any(p.name == MANIFEST for p in home().rglob("*"))
    assert [p.name for p in home().iterdir()] == [".locks"]  # the pull's lock; no staging folder was made


# --- a damaged store ---------------------------------------------------------------------------------------


def test_damaged_folders_do_not_break_ls_rm_or_info(hub_server, models):
    hub_server.add_repo(REPO, {"Tiny-Llama-Q4_0.gguf": models["Q4_0"]})
    assert llamaterm("pull", REPO).returncode == 0
    for name, manifest in (
        ("empty-object", "{}"),
        ("a-list", "[]"),
        ("escapes", '{"format": "gguf", "files": [{"path": "/etc/passwd.gguf"}]}'),
    ):
        (home() / name).mkdir()
        (home() / name / MANIFEST).write_text(manifest)
    damaged = home() / "bad-header"
    damaged.mkdir()
    (damaged / "config.json").write_text('{"model_type": "llama"}')
    (damaged / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    (home() / "bad-config").mkdir()  # JSON nested past Python's recursion limit: its reading failed, and ls with it
    write_dense(home() / "bad-config")
    (home() / "bad-config" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert [m["name"] for m in ls()] == ["tiny-llama-q4_0"]  # ls and rm broke on each of these
    assert llamaterm("rm", "-y", "tiny-llama-q4_0").returncode == 0
    assert ls() == []
    r = llamaterm("info", "/")  # walked the whole filesystem, then a traceback
    assert_user_error(r, "not a readable safetensors checkpoint")

    # each damaged folder is named, not hidden: ls says so, using one says so, and rm removes it
    told = llamaterm("ls").stderr.splitlines()
    for name in ("a-list", "bad-config", "bad-header", "empty-object", "escapes"):
        assert any(
            line.startswith(f"llamaterm: {name} is not a model") and f"llamaterm rm {name}" in line for line in told
        ), told
        assert_user_error(llamaterm("run", "--model", name, "hi"), f"the stored model {name!r} is damaged")
    assert "bad-header/model.safetensors" in "".join(told)  # with the reason
    assert llamaterm("rm", "-y", "a-list").returncode == 0
    assert not (home() / "a-list").exists() and (home() / "escapes").exists()
