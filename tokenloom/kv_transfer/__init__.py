"""KV connectors: move KV blocks between an engine and the outside (another engine, host memory, disk).

A connector has two halves, after vLLM v1's KVConnectorBase_V1 split:
- the scheduler side (`base.SchedulerConnector`, in the EngineCore) decides: how many prompt tokens
  are available outside for a request, what to load into the blocks just allocated, and whether a
  finished request's blocks must outlive it (a prefill instance keeps them until a decoder pulls them);
- the worker side (`base.WorkerConnector`, beside the model runner) moves the bytes, once per step,
  before the forward (loads, saves of blocks about to be overwritten) and after it (publishing).
They talk only through the step contract: `metadata.KVConnectorMetadata` on the SchedulerOutput,
`metadata.KVConnectorOutput` on the ModelRunnerOutput.

Two connectors: `ZmqConnector` (prefill/decode disaggregation over ZMQ frames, `pd_scheduler` and
`pd_worker`) and the offload tier (`offload_scheduler`, `offload_worker`, `offload_store`).
"""
