"""Helpers shared by the tests and the benchmarks, kept out of the installed packages."""
