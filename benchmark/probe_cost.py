"""What the weight-sync guard's learner half costs by probe length: the probe's forward (`token_logprobs`, as
`weight_check` runs it) and the checksums of every tensor, one torch thread, median of --repeats after a warm-up.

    python benchmark/probe_cost.py                          # models/SmolLM2-135M-Instruct (made by install.sh)
    python benchmark/probe_cost.py --policy DIR --repeats 3

Prints one line per piece (seconds). Issue 43: below ~8 tokens the forward costs what one read of the weights costs.
"""

import argparse
import statistics
import time

import common

REPO = common.REPO


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 16, 8, 4, 2])
    options = parser.parse_args()
    dpo = common.load_script("async_dpo.py")  # the scripts' own token_logprobs and bit_checksum
    import torch

    dpo.SET_TORCH_THREADS(1)
    policy = dpo.load_causal_lm(options.policy, "cpu")
    weights = policy.state_dict()

    def median_seconds(work):
        work()  # warm-up
        times = []
        for _ in range(options.repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with torch.no_grad():
        for length in options.lengths:
            ids = torch.arange(100, 100 + length)[None]
            seconds = median_seconds(
                lambda: dpo.token_logprobs(policy, ids, torch.ones_like(ids), torch.ones_like(ids), 1.0)
            )
            print(f"probe forward, {length} tokens: {seconds:.3f} s", flush=True)
        for dtype in (torch.float32, torch.bfloat16):
            seconds = median_seconds(lambda: {n: dpo.bit_checksum(t, dtype) for n, t in weights.items()})
            print(f"checksums of {len(weights)} tensors in {dtype}: {seconds:.3f} s", flush=True)


if __name__ == "__main__":
    main()
