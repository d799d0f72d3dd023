"""StrataCL benchmark suite: `python -m benchmarks [collectives|moe|train]` (see __main__)."""
