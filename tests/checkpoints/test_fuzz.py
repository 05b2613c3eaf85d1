"""Mutated model files (tests/support/fuzz.py): every one loads, or fails with a one-line LlamatermError; never a
traceback, a hang, a crash or an allocation past the memory cap.

CI runs FUZZ_CASES cases of a fixed seed (13 s on the 2-core CI machine), stopping at CI_SECONDS on a slower one
so that the whole test stays under a minute. `make fuzz` runs longer, with a new seed each time:
LLAMATERM_FUZZ_SEED, LLAMATERM_FUZZ_CASES and LLAMATERM_FUZZ_SECONDS set them; a failure names the seed and case
number that reproduce it."""

import os

import pytest

from tests.support.fuzz import fuzz

pytestmark = pytest.mark.slow  # a capped loader process, for up to a minute

FUZZ_CASES = 500
CI_SECONDS = 40  # the cases' share of the minute; making the seeds and starting the worker take the rest


def test_mutated_model_files_load_or_fail_in_one_line(tmp_path):
    seed = int(os.environ.get("LLAMATERM_FUZZ_SEED", 0))
    cases = int(os.environ.get("LLAMATERM_FUZZ_CASES", FUZZ_CASES))
    seconds = float(os.environ.get("LLAMATERM_FUZZ_SECONDS", CI_SECONDS))
    ran, failures = fuzz(tmp_path, seed, cases, seconds)
    assert not failures, f"{len(failures)} of {ran} cases failed:\n\n" + "\n\n".join(failures[:10])
    assert ran >= min(cases, 50)
