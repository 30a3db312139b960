"""The estimator: audited, time-calibrated static estimates of RPA kernels without a TPU.

* ``trace``: libtpu's simulated bundle trace, read (what work the profiler followed).
* ``profiler``: compile a lowered kernel in a child process with libtpu's static profiler
  on; cycles per kernel and the trace's statistics.
* ``calibration``: per-generation clock, DMA granule and MXU rates measured from the
  profiler itself (probe kernels), shipped as package data.
* ``audit``: the trace against the work a workload needs; the time model.
* ``compose``: a config's cost from a few small probe compiles, for any workload.
"""
