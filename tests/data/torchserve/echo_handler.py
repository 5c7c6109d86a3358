"""A function entry point (a module-level ``handle``) that streams: two
intermediate responses, then the final one; it echoes the request's
Content-Type header and answers TorchServe's explain header."""

from ts.handler_utils.utils import send_intermediate_predict_response


def handle(data, context):
    if data is None:  # TorchServe calls the entry point once with no data to initialise
        return None
    if context.get_request_header(0, "explain"):
        return [{"explanation": len(row.get("body") or b"")} for row in data]
    for part in ("first;", "second;"):
        send_intermediate_predict_response(
            [part for _ in data], context.request_ids, "Intermediate", 200, context
        )
    content_type = context.get_request_header(0, "content-type") or ""
    return [f"last:{content_type}" for _ in data]
