"""`llamaterm pull PATH`: a GGUF file (single or split) or a safetensors folder on this machine, added to the store
under a name and checked as a download is; and `hf.co/OWNER/REPO:QUANT` references, as ollama takes them, in `pull`
and in `--model`. The CLI runs as a subprocess, in a store of the test's own (tests/store/conftest.py)."""

import hashlib
import os

import pytest

from llamaterm.engine.store.model_store import MANIFEST, resolve_model
from tests.support.hub_store import assert_store_empty, assert_user_error, home, llamaterm, ls, stored

pytestmark = pytest.mark.slow  # `llamaterm` in subprocesses


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_pull_a_gguf_file_on_this_machine(hub_server, models, tmp_path):
    source = tmp_path / "Tiny-Llama-3B-Instruct-Q4_K_M.gguf"
    source.write_bytes(models["llama"])
    r = llamaterm("pull", str(source))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "tiny-llama-3b-instruct-q4_k_m\n"  # named as a pull of that file's repo would be
    assert f"importing {source} (gguf: 1 file, " in r.stderr
    folder = home() / "tiny-llama-3b-instruct-q4_k_m"
    assert sorted(p.name for p in folder.iterdir()) == sorted([source.name, MANIFEST])
    assert os.path.samefile(folder / source.name, source)  # linked, not copied: the same disk holds both
    manifest = stored("tiny-llama-3b-instruct-q4_k_m")
    assert manifest["source"] == str(source) and manifest["format"] == "gguf" and manifest["quant"] == "Q4_K_M"
    assert manifest["files"] == [{"path": source.name, "size": len(models["llama"]), "sha256": sha256(models["llama"])}]
    (row,) = ls()
    assert (row["name"], row["architecture"], row["context_length"]) == (folder.name, "llama", 256)
    assert not any((home() / ".partial").iterdir())

    again = llamaterm("pull", str(source))  # the name is taken: it says so, and by what
    assert_user_error(again, "the store already has a model named tiny-llama-3b-instruct-q4_k_m", str(source))
    named = llamaterm("pull", str(source), "--name", "mine")
    assert named.returncode == 0 and named.stdout == "mine\n"
    assert resolve_model("mine") == home() / "mine" / source.name
    assert hub_server.requests == []  # a path never asks the Hub


def test_pull_a_split_gguf_takes_every_part(hub_server, models, tmp_path):
    for i in (1, 2, 3):
        (tmp_path / f"Tiny-Q8_0-0000{i}-of-00003.gguf").write_bytes(models[f"split{i}"])
    second = llamaterm("pull", str(tmp_path / "Tiny-Q8_0-00002-of-00003.gguf"))
    assert_user_error(second, "part 2 of a split GGUF: give its first part")
    r = llamaterm("pull", str(tmp_path / "Tiny-Q8_0-00001-of-00003.gguf"))
    assert r.returncode == 0 and r.stdout == "tiny-q8_0\n", r.stderr
    assert sorted(p.name for p in (home() / "tiny-q8_0").glob("*.gguf")) == [
        f"Tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)
    ]
    (tmp_path / "Tiny-Q8_0-00003-of-00003.gguf").unlink()
    missing = llamaterm("pull", str(tmp_path / "Tiny-Q8_0-00001-of-00003.gguf"), "--name", "half")
    assert_user_error(missing, "split in 3 parts, and Tiny-Q8_0-00003-of-00003.gguf is not beside it")


def test_pull_a_safetensors_folder_takes_the_model_files_only(hub_server, safetensors_repo, tmp_path):
    folder = tmp_path / "Tiny-Llama"
    folder.mkdir()
    for name, data in safetensors_repo.items():
        (folder / name).write_bytes(data)
    (folder / "pytorch_model.bin").write_bytes(b"a pickle")
    (folder / "notes.txt").write_text("mine")
    r = llamaterm("pull", str(folder))
    assert r.returncode == 0 and r.stdout == "tiny-llama\n", r.stderr
    assert sorted(p.name for p in (home() / "tiny-llama").iterdir()) == sorted([*safetensors_repo, MANIFEST])
    (row,) = ls()
    assert (row["format"], row["architecture"]) == ("safetensors", "llama")
    run = llamaterm("run", "--model", "tiny-llama", "--max-tokens", "3", "--temperature", "0", "Hi")
    assert run.returncode == 0, run.stderr


def test_a_path_that_is_no_model_is_refused_and_leaves_nothing(hub_server, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a GGUF at all")
    assert_user_error(llamaterm("pull", str(fake)), f"{fake} holds no checkpoint llamaterm can read", "not a GGUF")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "pytorch_model.bin").write_bytes(b"a pickle")
    assert_user_error(llamaterm("pull", str(tmp_path / "weights")), "is not a model folder llamaterm reads")
    text = tmp_path / "model.txt"
    text.write_text("hi")
    assert_user_error(llamaterm("pull", str(text)), "is not a .gguf file")
    assert_store_empty()
    for missing in ("./no-such.gguf", "../no/such/folder"):
        r = llamaterm("pull", missing)
        assert r.returncode == 2 and f"no such file or folder: {missing}" in r.stderr, r.stderr


def test_hf_co_references_pull_and_run_as_ollama_takes_them(hub_server, models):
    hub_server.add_repo("tester/Tiny-Llama-GGUF", {"Tiny-Llama-Q4_K_M.gguf": models["llama"]})
    r = llamaterm("pull", "hf.co/tester/Tiny-Llama-GGUF:q4_k_m")
    assert r.returncode == 0 and r.stdout == "tiny-llama-q4_k_m\n", r.stderr
    for ref in (
        "hf.co/tester/Tiny-Llama-GGUF:Q4_K_M",
        "tester/Tiny-Llama-GGUF",
        "https://huggingface.co/tester/Tiny-Llama-GGUF",
    ):
        run = llamaterm("run", "--model", ref, "--max-tokens", "2", "--temperature", "0", "Hi")
        assert run.returncode == 0, (ref, run.stderr)
    absent = llamaterm("run", "--model", "hf.co/tester/Other-GGUF:Q8_0", "Hi")
    assert_user_error(
        absent, "hf.co/tester/Other-GGUF:Q8_0 is not in the store: `llamaterm pull hf.co/tester/Other-GGUF:Q8_0`"
    )
