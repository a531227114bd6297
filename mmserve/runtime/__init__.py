"""The engine process: its loop (messages in, steps, messages out), its intake (encoding or receiving a
request's media before the engine admits it) and the assembler of embedding parts from encoder services. It
composes the layers below it: the engine, the local encoder, the transports and the P/D handoff."""
