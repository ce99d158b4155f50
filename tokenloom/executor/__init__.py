"""The seam between the EngineCore and the devices: the step contract, executors and the worker."""
