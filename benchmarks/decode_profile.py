"""Decode-step kernel profile (see `qerl.bench.decode_profile`): python benchmarks/decode_profile.py --help"""

from qerl.bench.decode_profile import main

if __name__ == "__main__":
    raise SystemExit(main())
