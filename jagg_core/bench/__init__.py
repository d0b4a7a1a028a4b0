"""Update-stage benchmark (`jagg bench`): exact vs JAGG vs ablate side by side on one stored rollout and one policy.

- :mod:`.models`: the benchmarked policies (built-in ``toy``/``large``, or a profile's), the stored experience, the
  variants, and the update exactly as the trainer runs it.
- :mod:`.timing`: interleaved timing, the cost model's ideal from measured costs, gradient fidelity per K.
- :mod:`.memory`: peak memory per variant, one process each.
- :mod:`.comm`: all-reduces (``AllReduceSync``) and FSDP2 all-gathers in backward, with 2 gloo processes.
- :mod:`.rounds`: each timed round kept on disk as it ends, so that a stopped bench continues from them.
- :mod:`.progress`: which round, method and window the timing is in, and the time left (tqdm).
- :mod:`.run`: one model's whole run as a JSON dict.

``tasks/bench.py`` is the command; ``jagg_core/pipeline/bench_docs.py`` writes docs/benchmarks.md from its results.
"""

from .models import (BENCH_METHODS, BUILTIN_MODELS, BenchError, ModelSpec, bench_method, build_policy, make_experience,
                     model_spec, profile_spec)
from .rounds import RoundStore, discard_rounds
from .run import BenchConfig, machine_info, run_bench, save_result

__all__ = [
    "BUILTIN_MODELS",
    "BenchConfig",
    "BenchError",
    "ModelSpec",
    "RoundStore",
    "BENCH_METHODS",
    "bench_method",
    "build_policy",
    "discard_rounds",
    "machine_info",
    "make_experience",
    "model_spec",
    "profile_spec",
    "run_bench",
    "save_result",
]
