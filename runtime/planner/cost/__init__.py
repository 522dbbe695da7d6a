"""Cost and memory models: the model itself, analytic prior, profiles, profiler, calibration, runtime memory."""
