"""CuTe DSL kernels of the query stage (installed as graphstep.kernels)."""
