"""Mutated model files (tests/fuzz.py): every one loads, or fails with a one-line LlamatermError; never a traceback,
a hang, a crash or an allocation past the memory cap.

CI runs FUZZ_CASES cases of a fixed seed (about 20 s on the 2-core CI
machine). `make fuzz` runs longer, with a new seed each time: LLAMATERM_FUZZ_SEED, LLAMATERM_FUZZ_CASES and
LLAMATERM_FUZZ_SECONDS set them; a failure names the seed and case number that reproduce it."""

import os

from tests.fuzz import fuzz

FUZZ_CASES = 500


def test_mutated_model_files_load_or_fail_in_one_line(tmp_path):
    seed = int(os.environ.get("LLAMATERM_FUZZ_SEED", 0))
    cases = int(os.environ.get("LLAMATERM_FUZZ_CASES", FUZZ_CASES))
    seconds = float(os.environ.get("LLAMATERM_FUZZ_SECONDS", 60))
    ran, failures = fuzz(tmp_path, seed, cases, seconds)
    assert not failures, f"{len(failures)} of {ran} cases failed:\n\n" + "\n\n".join(failures[:10])
    assert ran >= min(cases, 50)
