"""A request's path through a prefill or a decode server (kv_transfer_params in the request body, as in vLLM)."""
import dataclasses

from mtpserve.disagg.connector import KVConnector
from mtpserve.disagg.transport import TransferError
from mtpserve.serve.protocol import APIError

FIELD = "kv_transfer_params"


@dataclasses.dataclass
class Disaggregated:
    """How the server runs this request: prompts/params to use, how the engine takes it, and (prefill) whom
    to park once it is done."""
    prompts: list
    params: list
    add: object = None
    park: bool = False


async def prepare(connector: KVConnector | None, kv: dict, req, prompts: list, params: list, make_params) -> Disaggregated:
    if connector is None:
        raise APIError(f"'{FIELD}': this server was started without --kv-transfer-config", param=FIELD)
    if len(prompts) != 1 or params[0].n != 1 or (params[0].best_of or 1) > 1:
        raise APIError(f"'{FIELD}': a disaggregated request has one prompt and n = best_of = 1", param=FIELD)
    for name in ("logprobs", "prompt_logprobs"):   # (the hand-off carries tokens and KV, not scores)
        if getattr(params[0], name) is not None:
            raise APIError(f"'{name}' is not supported with '{FIELD}' (disaggregated serving)", param=name)
    if kv.get("do_remote_decode"):
        if not connector.config.produces:
            raise APIError(f"'{FIELD}': do_remote_decode, but this server's kv_role is "
                           f"{connector.config.kv_role!r}", param=FIELD)
        if req.stream:
            raise APIError(f"'{FIELD}': a prefill (do_remote_decode) answers once: 'stream' must be false",
                           param="stream")
        return Disaggregated(prompts, [dataclasses.replace(params[0], max_tokens=1)],
                             lambda engine, *args: engine.add_request(*args, hold_kv=True), park=True)
    if kv.get("do_remote_prefill"):
        if not connector.config.consumes:
            raise APIError(f"'{FIELD}': do_remote_prefill, but this server's kv_role is "
                           f"{connector.config.kv_role!r}", param=FIELD)
        try:
            handoff = await connector.pull(kv)
        except ValueError as e:
            raise APIError(str(e), param=FIELD)
        except (TransferError, OSError) as e:
            raise APIError(f"KV transfer failed: {e}", status=502, type="server_error", code="kv_transfer_failed")
        text = prompts[0][0]
        prompts = [(text, handoff.prompt_token_ids)]
        return Disaggregated(prompts, [make_params(len(handoff.prompt_token_ids))], KVConnector.importer(handoff))
    raise APIError(f"'{FIELD}': needs do_remote_decode (prefill) or do_remote_prefill (decode)", param=FIELD)
