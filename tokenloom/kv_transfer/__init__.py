"""KV connectors: move KV blocks between an engine and the outside (another engine, host memory, disk).

A connector has two halves, after vLLM v1's KVConnectorBase_V1 split:
- the scheduler side (`base.SchedulerConnector`, in the EngineCore) decides: how many prompt tokens
  are available outside for a request, what to load into the blocks just allocated, and whether a
  finished request's blocks must outlive it (a prefill instance keeps them until a decoder pulls them);
- the worker side (`base.WorkerConnector`, beside the model runner) moves the bytes, layer by layer:
  `start_load_kv` before the forward, `wait_for_layer_load(i)` / `save_kv_layer(i)` around layer i
  (`layerwise.LayerwiseCaches` calls them as the model walks its caches; `worker_hook` wires it all
  around the runner), `wait_for_save` after the forward, `get_finished` for the step's report.
They talk only through the step contract: `metadata.KVConnectorMetadata` on the SchedulerOutput,
`metadata.KVConnectorOutput` on the ModelRunnerOutput; with tensor parallelism `rank_reports` combines the
ranks' reports on rank 0.

Two connectors: `ZmqConnector` (prefill/decode disaggregation over ZMQ, `pd_scheduler`, `pd_worker`, the
producer's `transport` and the decoder's `puller`; `trust` says who may set a request's kv_transfer_params)
and the offload tier (`offload_scheduler`, `offload_worker`, `offload_store`).
"""
