"""`llamaterm pull / ls / rm / info` against a local Hub look-alike (tests/support/hub_server.py).

Each test gets a fresh server, HF_ENDPOINT pointing at it, and LLAMATERM_HOME / HF_HOME in a tmp dir, so the
real store and the real Hub are never touched. The CLI runs as a subprocess (real exit codes, real signals)
where the command line is the point; other pulls call engine.hub.pull in-process, which saves a torch import
per pull.
"""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llamaterm.engine.checkpoints.gguf_files import SPLIT_GGUF
from llamaterm.engine.store import hub
from llamaterm.engine.store.model_store import DEFAULT_GGUF, MANIFEST, resolve_model
from tests.store.conftest import CHAT_TEMPLATE, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS
from tests.support.cli import LLAMATERM, interruptible
from tests.support.hub_store import assert_store_empty, assert_user_error, home, llamaterm, ls, stored

pytestmark = pytest.mark.slow  # `llamaterm` in subprocesses, pulling from a Hub look-alike

TOKEN = "hf_test_token"


def n_params(vocab: int) -> int:
    head_dim = HIDDEN // HEADS
    attention = 2 * HIDDEN * HEADS * head_dim + 2 * HIDDEN * KV_HEADS * head_dim
    per_layer = attention + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    return vocab * HIDDEN + LAYERS * per_layer + HIDDEN  # tied embeddings, final norm


def pull(ref: str, **kwargs):
    """engine.hub.pull in this process; returns the stored model."""
    return hub.pull(ref, **kwargs)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def partials() -> list[Path]:
    return sorted((home() / ".partial").glob("*/**/*.part"))


# --- pull: GGUF --------------------------------------------------------------------------------------------


def test_pull_single_gguf(hub_server, models):
    commit = hub_server.add_repo(
        "tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": models["llama"], "README.md": b"# Tiny\n"}
    )
    r = llamaterm("pull", "tester/Tiny-Llama-GGUF")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "tiny-llama-q4_k_m\n"
    assert "B/s" in r.stderr and "Tiny-Llama-Q4_K_M.gguf" in r.stderr  # the progress bar: size, speed, ETA

    folder = home() / "tiny-llama-q4_k_m"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["Tiny-Llama-Q4_K_M.gguf", MANIFEST])
    assert (folder / "Tiny-Llama-Q4_K_M.gguf").read_bytes() == models["llama"]
    manifest = stored("tiny-llama-q4_k_m")
    assert manifest["repo"] == "tester/Tiny-Llama-GGUF" and manifest["revision"] == commit
    assert manifest["files"] == [
        {"path": "Tiny-Llama-Q4_K_M.gguf", "size": len(models["llama"]), "sha256": sha256(models["llama"])}
    ]
    assert hub_server.gets("README.md") == []
    assert partials() == [] and not any((home() / ".partial").iterdir())

    (row,) = ls()
    assert row["name"] == "tiny-llama-q4_k_m" and row["format"] == "gguf" and row["quant"] == "Q4_K_M"
    assert row["architecture"] == "llama" and row["context_length"] == 256
    assert row["parameters"] == n_params(49152)
    assert row["size"] == sum(p.stat().st_size for p in folder.iterdir())
    assert resolve_model("tiny-llama-q4_k_m") == folder / "Tiny-Llama-Q4_K_M.gguf"

    again = llamaterm("pull", "tester/Tiny-Llama-GGUF")  # up to date: nothing fetched twice
    assert again.returncode == 0 and again.stdout == "tiny-llama-q4_k_m\n"
    assert "up to date" in again.stderr
    assert hub_server.gets("Tiny-Llama-Q4_K_M.gguf") == [None]


def test_pull_split_gguf(hub_server, models):
    parts = {f"Tiny-Q8_0-0000{i}-of-00003.gguf": models[f"split{i}"] for i in (1, 2, 3)}
    hub_server.add_repo("tester/Split-GGUF", parts)
    assert pull("tester/Split-GGUF").name == "split-q8_0"
    for name, data in parts.items():
        assert (home() / "split-q8_0" / name).read_bytes() == data
    (row,) = ls()
    assert row["quant"] == "Q8_0" and row["parameters"] == n_params(256)  # tensors of all three parts
    assert resolve_model("split-q8_0") == home() / "split-q8_0" / "Tiny-Q8_0-00001-of-00003.gguf"


def test_quant_selection(hub_server, models):
    files = {
        "Tiny-Q2_K.gguf": models["Q8_0"],
        "Tiny-Q4_K_S.gguf": models["Q4_0"],
        "Tiny-Q4_K_M.gguf": models["Q4_0"],
        "Tiny-Q8_0.gguf": models["Q8_0"],
        "mmproj-Tiny-F16.gguf": models["F16"],
    }
    hub_server.add_repo("tester/Tiny-GGUF", files)

    assert pull("tester/Tiny-GGUF").name == "tiny-q4_k_m"  # no quant: Q4_K_M
    assert pull("tester/Tiny-GGUF:q8_0").name == "tiny-q8_0"  # case-insensitive
    assert (home() / "tiny-q8_0" / "Tiny-Q8_0.gguf").read_bytes() == models["Q8_0"]
    fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub_server.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {"Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf"}

    r = llamaterm("pull", "tester/Tiny-GGUF:Q5_K_M")  # not there: say what is
    assert_user_error(r, "no quant Q5_K_M", "Q2_K, Q4_K_M, Q4_K_S, Q8_0")

    # Without Q4_K_M, the closest 4-bit quant.
    hub_server.add_repo(
        "tester/NoKM-GGUF",
        {
            "m-Q3_K_M.gguf": models["Q8_0"],
            "m-IQ4_XS.gguf": models["Q4_0"],
            "m-Q4_0.gguf": models["Q4_0"],
            "m-Q8_0.gguf": models["Q8_0"],
        },
    )
    assert pull("tester/NoKM-GGUF").name == "nokm-iq4_xs"

    # No 4-bit quant: the choices, ready to paste.
    hub_server.add_repo("tester/Big-GGUF", {"b-Q8_0.gguf": models["Q8_0"], "b-F16.gguf": models["F16"]})
    assert_user_error(llamaterm("pull", "tester/Big-GGUF"), "tester/Big-GGUF:F16, tester/Big-GGUF:Q8_0")

    # Two files with one label: ambiguous, and each can be named by its file stem.
    hub_server.add_repo("tester/Two-GGUF", {"base-Q4_K_M.gguf": models["Q4_0"], "chat-Q4_K_M.gguf": models["Q8_0"]})
    r = llamaterm("pull", "tester/Two-GGUF")
    assert_user_error(r, "tester/Two-GGUF:base-Q4_K_M", "tester/Two-GGUF:chat-Q4_K_M")
    r = llamaterm("pull", "tester/Two-GGUF:chat-q4_k_m", "--name", "two-chat")
    assert r.returncode == 0 and r.stdout == "two-chat\n", r.stderr
    assert (home() / "two-chat" / "chat-Q4_K_M.gguf").read_bytes() == models["Q8_0"]


@pytest.mark.parametrize(
    "filename, label",
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),  # bartowski
        ("llama-2-7b-chat.Q5_K_S.gguf", "Q5_K_S"),  # TheBloke
        ("Q4_K_M/Meta-Llama-3.1-70B-Instruct-Q4_K_M-00001-of-00002.gguf", "Q4_K_M"),
        ("Llama-3.2-3B-Instruct-UD-Q4_K_XL.gguf", "Q4_K_XL"),  # unsloth
        ("qwen2.5-0.5b-instruct-iq4_xs.gguf", "IQ4_XS"),
        ("tinyllama-1.1b-chat-v1.0.f16.gguf", "F16"),
        ("model.gguf", None),
    ],
)
def test_quant_labels_of_real_file_names(filename, label):
    m = SPLIT_GGUF.match(filename)
    assert hub.quant_label(m["prefix"] if m else filename.removesuffix(".gguf")) == label


def test_mixture_of_experts_repos_pick_as_their_users_name_them():
    """The files of the MoE repos people pull (unsloth's Qwen3-30B-A3B quants, split BF16 in a folder; ggml-org's
    one gpt-oss file): no quant picks Q4_K_M, and the one MXFP4 file; each by its label too."""
    qwen = [
        *(f"Qwen3-30B-A3B-{q}.gguf" for q in ("IQ4_XS", "Q3_K_M", "Q4_K_M", "Q6_K", "Q8_0", "UD-Q4_K_XL")),
        "BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf",
        "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf",
    ]
    units = hub.gguf_units(qwen)
    repo = "unsloth/Qwen3-30B-A3B-GGUF"
    assert hub.pick_gguf(repo, units, None) == ("Q4_K_M", ["Qwen3-30B-A3B-Q4_K_M.gguf"])
    assert hub.pick_gguf(repo, units, "Q4_K_XL") == ("Q4_K_XL", ["Qwen3-30B-A3B-UD-Q4_K_XL.gguf"])
    assert hub.pick_gguf(repo, units, "bf16")[1] == qwen[-2:]
    units = hub.gguf_units(["gpt-oss-20b-mxfp4.gguf"])
    for quant in (None, "MXFP4", "mxfp4"):
        assert hub.pick_gguf("ggml-org/gpt-oss-20b-GGUF", units, quant) == ("MXFP4", ["gpt-oss-20b-mxfp4.gguf"])


# --- pull: safetensors -------------------------------------------------------------------------------------


def test_pull_safetensors_never_fetches_pickles(hub_server, safetensors_repo):
    files = {
        **safetensors_repo,
        "pytorch_model.bin": b"\x80\x04 a pickle that must never be fetched",
        "original/consolidated.00.pth": b"\x80\x04 another one",
        "README.md": b"# A model\n",
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }
    hub_server.add_repo("tester/Tiny-Llama", files)
    r = llamaterm("pull", "tester/Tiny-Llama")
    assert r.returncode == 0 and r.stdout == "tiny-llama\n", r.stderr

    folder = home() / "tiny-llama"
    wanted = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*wanted, MANIFEST])
    for name in wanted:
        assert (folder / name).read_bytes() == files[name]
    fetched = [p for m, p, _ in hub_server.requests if "/resolve/" in p]
    assert not [p for p in fetched if p.endswith((".bin", ".pth", "README.md"))]
    assert {f["path"]: f["sha256"] for f in stored("tiny-llama")["files"]} == {n: sha256(files[n]) for n in wanted}

    (row,) = ls()
    assert (row["format"], row["quant"], row["architecture"]) == ("safetensors", "F32", "llama")
    assert row["parameters"] == n_params(256) and row["context_length"] == 256
    assert resolve_model("tiny-llama") == folder
    info = json.loads(llamaterm("info", "tiny-llama", "--json").stdout)
    assert info["chat_template"] == CHAT_TEMPLATE and info["tensor_types"] == {"F32": 2 + 9 * LAYERS}


# --- interruptions and corruption --------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_download_resumes(hub_server, models, sig):
    data = models["llama"]
    hub_server.add_repo("tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": data})
    hub_server.bytes_per_s = 1_000_000
    proc = subprocess.Popen(
        [LLAMATERM, "pull", "tester/Tiny-Llama-GGUF"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    deadline = time.monotonic() + 60
    while not (partials() and partials()[0].stat().st_size > 300_000):
        assert proc.poll() is None and time.monotonic() < deadline, "the download never got going"
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    if sig == signal.SIGINT:  # Ctrl-C: a clear word, and the partial download kept
        assert proc.returncode == 130 and "run the same command again to resume" in err
        assert "Traceback" not in err
    assert out == ""
    assert_store_empty()
    (part,) = partials()
    kept = part.stat().st_size
    assert 300_000 <= kept < len(data)

    hub_server.bytes_per_s = None
    r = llamaterm("pull", "tester/Tiny-Llama-GGUF")
    assert r.returncode == 0, r.stderr
    assert "resuming Tiny-Llama-Q4_K_M.gguf" in r.stderr
    assert hub_server.gets("Tiny-Llama-Q4_K_M.gguf")[-1] == f"bytes={kept}-"
    assert (home() / "tiny-llama-q4_k_m" / "Tiny-Llama-Q4_K_M.gguf").read_bytes() == data
    assert partials() == []


def test_dropped_connection_resumes_within_the_pull(hub_server, models):
    data = models["llama"]
    hub_server.add_repo("tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": data})
    hub_server.drop_after["Tiny-Llama-Q4_K_M.gguf"] = len(data) // 2
    said = []
    pull("tester/Tiny-Llama-GGUF", say=said.append)
    assert [m for m in said if m.startswith("connection lost")]
    assert hub_server.gets("Tiny-Llama-Q4_K_M.gguf") == [None, f"bytes={len(data) // 2}-"]
    assert (home() / "tiny-llama-q4_k_m" / "Tiny-Llama-Q4_K_M.gguf").read_bytes() == data


def test_network_down_mid_file(hub_server, models):
    data = models["llama"]
    hub_server.add_repo("tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": data})
    hub_server.outage_after["Tiny-Llama-Q4_K_M.gguf"] = len(data) // 3
    r = llamaterm("pull", "tester/Tiny-Llama-GGUF")
    assert_user_error(r, "network error while downloading Tiny-Llama-Q4_K_M.gguf", "run the same command again")
    assert_store_empty()
    assert [p.stat().st_size for p in partials()] == [len(data) // 3]

    hub_server.down = False  # the network is back
    pull("tester/Tiny-Llama-GGUF")
    assert hub_server.gets("Tiny-Llama-Q4_K_M.gguf")[-1] == f"bytes={len(data) // 3}-"
    assert (home() / "tiny-llama-q4_k_m" / "Tiny-Llama-Q4_K_M.gguf").read_bytes() == data


def test_corrupted_byte_is_caught(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    hub_server.corrupt.add("Tiny-Q4_0.gguf")
    r = llamaterm("pull", "tester/Tiny-GGUF")
    assert_user_error(r, "Tiny-Q4_0.gguf is corrupt", "pull again")
    assert_store_empty()
    assert partials() == []  # a corrupt download is not something to resume

    hub_server.corrupt.clear()
    pull("tester/Tiny-GGUF")
    assert (home() / "tiny-q4_0" / "Tiny-Q4_0.gguf").read_bytes() == models["Q4_0"]


def test_two_concurrent_pulls_leave_one_good_copy(hub_server, models):
    data = models["llama"]
    hub_server.add_repo("tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": data})
    hub_server.bytes_per_s = len(data) / 3  # a 3-second download, so the two overlap
    procs = [
        subprocess.Popen(
            [LLAMATERM, "pull", "tester/Tiny-Llama-GGUF"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    assert [(out, rc) for out, _, rc in results] == [("tiny-llama-q4_k_m\n", 0)] * 2
    errs = [err for _, err, _ in results]
    assert any("waiting for another pull" in e for e in errs) and any("up to date" in e for e in errs)
    assert hub_server.gets("Tiny-Llama-Q4_K_M.gguf") == [None]  # fetched once
    assert [p.name for p in home().iterdir() if not p.name.startswith(".")] == ["tiny-llama-q4_k_m"]
    assert (home() / "tiny-llama-q4_k_m" / "Tiny-Llama-Q4_K_M.gguf").read_bytes() == data
    assert partials() == []


def test_new_commit_replaces_the_stored_copy(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    pull("tester/Tiny-GGUF:Q4_0")
    commit = hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q8_0"]})
    pull("tester/Tiny-GGUF:Q4_0")
    assert (home() / "tiny-q4_0" / "Tiny-Q4_0.gguf").read_bytes() == models["Q8_0"]
    assert stored("tiny-q4_0")["revision"] == commit
    assert [m["name"] for m in ls()] == ["tiny-q4_0"]
    assert not any((home() / ".trash").iterdir())


def test_revision(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    v2 = hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q8_0"]}, branch="v2")
    pull("tester/Tiny-GGUF", revision="v2")
    assert stored("tiny-q4_0")["revision"] == v2
    assert (home() / "tiny-q4_0" / "Tiny-Q4_0.gguf").read_bytes() == models["Q8_0"]
    assert_user_error(llamaterm("pull", "tester/Tiny-GGUF", "-r", "v3"), "tester/Tiny-GGUF has no revision 'v3'")


# --- offline -----------------------------------------------------------------------------------------------


def test_offline_works_from_the_store_alone(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"], "Tiny-Q8_0.gguf": models["Q8_0"]})
    pull("tester/Tiny-GGUF:Q4_0")
    hub_server.stop()  # the store alone must do

    for args, env in [(["tester/Tiny-GGUF"], {"HF_HUB_OFFLINE": "1"}), (["tester/Tiny-GGUF:q4_0", "--offline"], {})]:
        r = llamaterm("pull", *args, **env)
        assert r.returncode == 0 and r.stdout == "tiny-q4_0\n", r.stderr
    assert_user_error(llamaterm("pull", "tester/Tiny-GGUF:Q8_0", "--offline"), "offline", "not in the store")
    assert_user_error(llamaterm("pull", "tester/Other", HF_HUB_OFFLINE="1"), "offline", "not in the store")
    assert llamaterm("ls", HF_HUB_OFFLINE="1").returncode == 0


# --- bad input ---------------------------------------------------------------------------------------------


def test_unknown_repo(hub_server):
    assert_user_error(llamaterm("pull", "tester/Nope"), "no repo tester/Nope", "HF_TOKEN")
    assert_store_empty()


def test_gated_repo_needs_a_token(hub_server, models, tmp_path, monkeypatch):
    hub_server.add_repo("tester/Gated-GGUF", {"Gated-Q4_0.gguf": models["Q4_0"]}, gated=True)
    hub_server.tokens.add(TOKEN)
    assert_user_error(llamaterm("pull", "tester/Gated-GGUF"), "tester/Gated-GGUF is gated", "hf auth login")
    assert hub_server.gets("Gated-Q4_0.gguf") == []  # known from the listing: no download tried
    r = llamaterm("pull", "tester/Gated-GGUF", HF_TOKEN="hf_without_access")  # refused by the download
    assert_user_error(r, "tester/Gated-GGUF is gated", "hf auth login")
    assert_store_empty()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    pull("tester/Gated-GGUF")
    assert llamaterm("rm", "--yes", "gated-q4_0").returncode == 0
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "hf" / "token").write_text(TOKEN)  # where `hf auth login` keeps it
    r = llamaterm("pull", "tester/Gated-GGUF")
    assert r.returncode == 0, r.stderr


def test_repo_without_usable_weights(hub_server):
    files = {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04 pickle", "README.md": b"hi"}
    hub_server.add_repo("tester/Pickles", files)
    assert_user_error(llamaterm("pull", "tester/Pickles"), "no GGUF or safetensors weights", "pickle")
    assert not [p for m, p, _ in hub_server.requests if "/resolve/" in p]
    hub_server.add_repo("tester/Weights-Only", {"model.safetensors": b"\x00" * 16})
    assert_user_error(llamaterm("pull", "tester/Weights-Only"), "no config.json")
    assert_store_empty()


def test_hub_unreachable(hub_server):
    r = llamaterm("pull", "tester/Tiny-GGUF", HF_ENDPOINT="http://127.0.0.1:9")
    assert_user_error(r, "cannot reach http://127.0.0.1:9")


def test_not_enough_disk_space(hub_server, models, monkeypatch):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    # In this process only: the CLI subprocesses below see the real disk.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12, free=1000))
    need = f"{len(models['Q4_0']) / 1000:.1f} kB"
    with pytest.raises(hub.PullError, match=rf"disk space to pull tiny-q4_0: it needs {need} more, .* 1.0 kB free"):
        hub.pull("tester/Tiny-GGUF")
    assert hub_server.gets("Tiny-Q4_0.gguf") == []
    assert_store_empty()


def test_disk_full_mid_file(hub_server, models):
    commit = hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    staging = home() / ".partial" / f"tiny-q4_0@{commit}"
    staging.mkdir(parents=True)
    (staging / "Tiny-Q4_0.gguf.part").symlink_to("/dev/full")  # every write fails with ENOSPC
    r = llamaterm("pull", "tester/Tiny-GGUF")
    assert_user_error(r, "disk full while downloading Tiny-Q4_0.gguf")
    assert not (staging / "Tiny-Q4_0.gguf.part").is_symlink()
    assert_store_empty()


def test_usage_errors_exit_2(hub_server):
    for args in (["pull", "just-a-name"], ["pull", "a/b/c"], ["pull", "a/b:"], ["pull", "a/b", "--name", "Bad Name"]):
        r = llamaterm(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert not hub_server.requests


def test_name_taken_by_another_repo(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    hub_server.add_repo("other/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q8_0"]})
    pull("tester/Tiny-GGUF")
    assert_user_error(llamaterm("pull", "other/Tiny-GGUF"), "already has a model named tiny-q4_0", "--name")
    assert pull("other/Tiny-GGUF", name="other-tiny").name == "other-tiny"
    assert (home() / "tiny-q4_0" / "Tiny-Q4_0.gguf").read_bytes() == models["Q4_0"]


def test_unknown_names_suggest_close_ones(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    pull("tester/Tiny-GGUF")
    assert_user_error(llamaterm("info", "tiny-q4"), "no model named 'tiny-q4'", "Did you mean: tiny-q4_0?")
    assert_user_error(llamaterm("rm", "--yes", "tiny-q5_0"), "Did you mean: tiny-q4_0?")
    assert_user_error(llamaterm("info", "llama"), "`llamaterm ls` lists the stored models")


# --- ls, rm, info ------------------------------------------------------------------------------------------


def test_ls_shows_the_default_model(hub_server, models):
    default = home() / "default" / DEFAULT_GGUF
    default.parent.mkdir(parents=True)
    default.write_bytes(models["Q4_0"])
    r = llamaterm("ls")
    assert r.returncode == 0
    header, line = r.stdout.splitlines()
    assert header.split() == ["NAME", "FORMAT", "QUANT", "ARCH", "PARAMS", "CONTEXT", "SIZE"]
    assert line.split()[:2] == ["default", "gguf"]
    (row,) = ls()
    assert (row["name"], row["architecture"], row["parameters"]) == ("default", "llama", n_params(256))
    assert row["path"] == str(default)
    (default.parent / MANIFEST).write_text("{ damaged")  # rebuilt from the checkpoint
    assert ls() == [row]


def test_ls_of_an_empty_store(hub_server):
    r = llamaterm("ls")
    assert r.returncode == 0 and r.stdout == "" and "llamaterm pull" in r.stderr


def test_rm_confirms_and_frees_the_disk(hub_server, models):
    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    pull("tester/Tiny-GGUF")
    r = llamaterm("rm", "tiny-q4_0", input="n\n")
    assert r.returncode == 1 and "Remove tiny-q4_0" in r.stderr
    assert (home() / "tiny-q4_0").exists()
    r = llamaterm("rm", "tiny-q4_0", input="y\n")
    assert r.returncode == 0 and "Removed tiny-q4_0" in r.stderr, r.stderr
    assert not (home() / "tiny-q4_0").exists()
    assert not any((home() / ".trash").iterdir())
    assert ls() == []


def test_rm_on_a_store_it_cannot_write_says_so_in_one_line(hub_server, models, monkeypatch, capsys):
    """A read-only store (or another user's files): the move into the store's trash fails. It was a traceback."""
    from llamaterm.app import cli

    hub_server.add_repo("tester/Tiny-GGUF", {"Tiny-Q4_0.gguf": models["Q4_0"]})
    pull("tester/Tiny-GGUF")

    def read_only(self, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "replace", read_only)
    monkeypatch.setattr(sys, "argv", ["llamaterm", "rm", "tiny-q4_0", "-y"])
    capsys.readouterr()  # the pull's own output
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("llamaterm: cannot remove tiny-q4_0: Read-only file system") and "writable" in line
    assert (home() / "tiny-q4_0").exists()


@pytest.mark.parametrize("ref", ["a/..", "a/b\x01c", "a--b/c", "owner/name/more", "a/b:", "a/b:q 4"])
def test_pull_of_what_is_no_repo_is_a_usage_error(hub_server, ref):
    r = llamaterm("pull", ref)
    assert r.returncode == 2 and "is not a model reference" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_info(hub_server, models):
    hub_server.add_repo("tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": models["llama"]})
    pull("tester/Tiny-Llama-GGUF")
    r = llamaterm("info", "tiny-llama-q4_k_m", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["repo"] == "tester/Tiny-Llama-GGUF" and info["quant"] == "Q4_K_M"
    assert info["metadata"]["general.name"] == "tiny-llama"
    assert info["metadata"]["tokenizer.ggml.tokens"] == "[49152 items]"
    # Q4_K rows of 64 values fall back to Q5_0 (tests/support/tiny_models.py); norms are F32.
    assert info["tensor_types"] == {"Q5_0": 15, "F32": 5}
    assert "<|im_start|>" in info["chat_template"]  # the default model's template, copied by tiny_models

    text = llamaterm("info", "tiny-llama-q4_k_m").stdout
    assert "tensor types  Q5_0 x15, F32 x5" in text
    assert "chat template\n{% for message in messages %}" in text


# --- the pulled model runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_run_on_a_pulled_model(hub_server, models, safetensors_repo, tmp_path, fmt):
    if fmt == "gguf":
        files, name = {"Tiny-Llama-Q4_K_M.gguf": models["llama"]}, "tiny-llama-q4_k_m"
    else:
        files, name = safetensors_repo, "tiny-llama"
    hub_server.add_repo("tester/Tiny-Llama" + "-GGUF" * (fmt == "gguf"), files)
    assert pull("tester/Tiny-Llama" + "-GGUF" * (fmt == "gguf")).name == name
    hub_server.stop()  # running needs the store only
    r = llamaterm("run", "--model", name, "--max-tokens", "4", "--temperature", "0", "--raw", "hello")
    assert r.returncode == 0, r.stderr
    for path, data in files.items():  # the same files, outside the store
        (tmp_path / path).write_bytes(data)
    same = tmp_path / "Tiny-Llama-Q4_K_M.gguf" if fmt == "gguf" else tmp_path
    by_path = llamaterm("run", "--model", str(same), "--max-tokens", "4", "--temperature", "0", "--raw", "hello")
    assert r.stdout == by_path.stdout and r.stdout.strip()  # greedy: the same checkpoint gives the same text
