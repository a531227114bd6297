"""Prefill-decode disaggregation: KV handoff between engines, the router that fronts prefill and decode
servers (`mmserve router`), and the one-machine pipeline launcher (`mmserve serve --prefill-workers`)."""
