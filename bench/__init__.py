"""kvflash's benchmarks, one module a benchmark, run from the repository root as
`python -m bench.NAME` (`--help` for each one's options); results in docs/BENCHMARKS.md. What they
share is in `bench.harness`."""
