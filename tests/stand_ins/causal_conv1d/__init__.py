"""Stand-in for causal-conv1d 1.7 (tests/stand_ins/README.md): only cpp_functions."""
