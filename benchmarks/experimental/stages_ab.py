"""The rollout benchmark with another pipeline depth for the Gluon decode kernel up to 8 rows (GPU).

`python benchmarks/experimental/stages_ab.py NS [rollout.py arguments]`: runs `benchmarks/rollout.py` with
`gluon_nvfp4.pick_config` returning NS stages for M <= 8 (the default is 3; session 6 used 4). The A/B of
docs/benchmarks.md ("3 pipeline stages instead of 4 up to 8 rows") alternated
`stages_ab.py 4 --models 7b --variants nvfp4+lora --batches 1,4,8` with the same command at 3.
"""

import sys

import qerl.kernels.gluon_nvfp4 as gk
from qerl.bench.rollout import main

_default = gk.pick_config


def _with_stages(stages: int):
    def pick(m: int, n: int, k: int):
        cfg, waves = _default(m, n, k)
        return ((*cfg[:4], stages), waves) if m <= 8 else (cfg, waves)

    return pick


if __name__ == "__main__":
    gk.pick_config = _with_stages(int(sys.argv[1]))
    raise SystemExit(main(sys.argv[2:]))
