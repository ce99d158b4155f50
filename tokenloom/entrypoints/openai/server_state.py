"""The server's own state beside the engine: draining on shutdown, and the admission and timeout settings."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.entrypoints.openai.lora_models import LoRAModels

DEFAULT_MAX_WAITING_REQUESTS = 256
# Default --max-expected-latency: the overload test's flood (400 concurrent 64-token requests, client timeout 180 s)
# is answered cleanly with a 3x margin for the estimate's error: the machine slowing down after admission,
# the rate guessed (40 tokens/s) before the first steps are measured. Measured: see README, "Overload".
DEFAULT_MAX_EXPECTED_LATENCY = 60.0
# Default --max-queue-wait: off; the expected latency above includes the wait.
DEFAULT_MAX_QUEUE_WAIT = 0.0
# Default --stream-write-timeout: a client that has not taken a chunk for this long (its socket
# and our buffers are full) has stalled; its stream ends and its connection closes.
DEFAULT_STREAM_WRITE_TIMEOUT = 30.0
class ServerState:
    """Set by the server on shutdown: new requests get 503 while the in-flight ones drain.

    Also the admission settings (see `OpenAIServing.admit`): `max_expected_latency` (seconds a new request
    may be expected to take to complete, None: no limit), `max_queue_wait` (the same for its wait alone),
    the count backstop
    `max_waiting_requests` (sequences waiting for a slot in the running batch), `request_timeout`
    (seconds, None: none) capping every request's time, and `stream_write_timeout`.
    """

    def __init__(self, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 request_timeout: float | None = None, trust_request_chat_template: bool = False,
                 max_queue_wait: float | None = DEFAULT_MAX_QUEUE_WAIT,
                 max_expected_latency: float | None = DEFAULT_MAX_EXPECTED_LATENCY,
                 stream_write_timeout: float | None = DEFAULT_STREAM_WRITE_TIMEOUT) -> None:
        self.draining = False
        # Render a chat_template sent with a request (in a limited process); off: such requests get 400.
        self.trust_request_chat_template = trust_request_chat_template
        self.inflight = 0
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.max_queue_wait = max_queue_wait if max_queue_wait and max_queue_wait > 0 else None
        self.max_expected_latency = max_expected_latency if max_expected_latency and max_expected_latency > 0 \
            else None
        self.stream_write_timeout = stream_write_timeout if stream_write_timeout and stream_write_timeout > 0 \
            else None
        self.lora_models: LoRAModels | None = None  # the LoRA adapters served by name (--enable-lora)




class ServerShuttingDownError(RuntimeError):
    """In-flight requests still open when the shutdown timeout ran out."""
