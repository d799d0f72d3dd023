"""The supernode model: what ops and whole steps would take on the supernode
(CloudMatrix384 by default), below the emulator that re-exports it as
`strata.emulator.model`, `trace`, `simulate`, `preset`, ...

  spec        SupernodeSpec and the presets (cited figures)
  op_model    one op, timed by the C++ model from the plan the runtime runs
  step_graph  a traced step as a graph of kernels and collectives
  step        the step model: that graph scheduled on the NPU's resources
  trace       recorded real runs beside their modeled twins (Perfetto JSON)

Nothing here imports the emulator or the ops (tests/test_layers.py)."""
