"""n choices of one prompt through the engine process: the prompt tokens computed for all of them, and the time to
the last choice's first token, with the choices submitted together (as `serve` submits a response's choices: they
fork from one prefill) and one by one (a choice a step late takes the prompt's full blocks from the prefix cache).

    python -m tests.benchmarks.forked_choices -m synthetic:llama3-8b
"""

import argparse

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.process import EngineProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default="synthetic:llama3-8b")
    parser.add_argument("--prompt", type=int, default=512)
    args = parser.parse_args()
    with EngineProcess(EngineConfig(model=args.model)) as engine:
        rows = []
        for trial, (n, together) in enumerate([(1, True), (8, True), (8, False)] * 2):
            vocab = min(30000, engine.vocab_size - 5)
            prompt = [(97 * t + 13 * trial) % vocab + 5 for t in range(args.prompt)]  # a new prompt: none cached
            params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=i) for i in range(n)]
            if together:
                with engine.together():
                    handles = [engine.submit(None, p, prompt_ids=prompt) for p in params]
            else:
                handles = [engine.submit(None, p, prompt_ids=prompt) for p in params]
            for h in handles:
                list(h.events())
            computed = sum(args.prompt - h.stats().cached_tokens for h in handles)
            last_first = max(h.stats().ttft_s or 0.0 for h in handles)
            rows.append((n, together, computed, 1e3 * last_first))
    print(f"{engine.model_name}, a {args.prompt}-token prompt (second of two rounds)")
    print("n  submitted   prompt tokens computed  last first token ms")
    for n, together, computed, ms in rows[3:]:
        print(f"{n:<2} {'together' if together else 'one by one':11} {computed:>22,} {ms:>20.1f}")


if __name__ == "__main__":
    main()
