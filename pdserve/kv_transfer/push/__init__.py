"""Push mode: P writes each layer's KV into D's registered blocks as soon as the layer is computed.

D registers its blocks with P's side channel, keyed by the gateway's transfer_id; the registration may arrive
before P starts, during its prefill, or after it has finished. ``consumer`` is D's side (registrations,
write-done, deadlines), ``producer`` P's engine-thread side (which blocks to write when), ``link`` P's end on
the transfer agent (what arrives, the writer thread, write-done going out), ``specs`` the per-step metadata.
"""

from pdserve.kv_transfer.push.consumer import PushConsumer, PushExpectation
from pdserve.kv_transfer.push.link import ProducerLink
from pdserve.kv_transfer.push.producer import PushProducer
from pdserve.kv_transfer.push.specs import PushChunk, PushEnded, PushRegistration

__all__ = ["ProducerLink", "PushChunk", "PushConsumer", "PushEnded", "PushExpectation", "PushProducer",
           "PushRegistration"]
