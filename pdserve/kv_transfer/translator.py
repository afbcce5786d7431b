"""The connector's translator between the two id domains (see `pdserve.ids`).

``TransferId`` (minted by the gateway, shared by every leg) names a transfer between instances; ``ReqId`` (this
instance's own, with its random suffix) names a request to the scheduler. Entries are made when a transfer
starts and removed when it ends, is aborted or times out, so the map's size is the number of live transfers.
"""

from __future__ import annotations

from pdserve.ids import ReqId, TransferId


class TransferMap:
    def __init__(self) -> None:
        self._request_of: dict[TransferId, ReqId] = {}
        self._transfer_of: dict[ReqId, TransferId] = {}

    def add(self, transfer_id: TransferId, request_id: ReqId) -> None:
        owner = self._request_of.get(transfer_id)
        if owner is not None and owner != request_id:
            # The first live owner keeps a transfer id (a replayed id must not hijack another request's KV).
            raise ValueError(f"transfer {transfer_id} already belongs to another request")
        self._request_of[transfer_id] = request_id
        self._transfer_of[request_id] = transfer_id

    def remove_request(self, request_id: ReqId) -> TransferId | None:
        transfer_id = self._transfer_of.pop(request_id, None)
        if transfer_id is not None:
            self._request_of.pop(transfer_id, None)
        return transfer_id

    def __len__(self) -> int:
        return len(self._request_of)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._request_of
