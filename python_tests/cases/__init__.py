"""Input builders shared by the test files of one family (CPU, emulated CUDA and CUDA tests)."""
