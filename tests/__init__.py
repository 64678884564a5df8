"""rlmill's tests. A package so that benchmarks can import the test servers (`tests.servers`)."""
