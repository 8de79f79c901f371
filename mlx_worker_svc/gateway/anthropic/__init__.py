"""Anthropic's Messages API in the gateway: `/v1/messages` (with its event stream) and
`/v1/messages/count_tokens`, on the OpenAI routes' completion flow (gateway.calls), tools
and errors. Imports what the rest of the gateway does; the gateway's app imports it.
"""
