"""The speculative loop: the engine, the request frontend, the sessions it drives, run-ahead and lockstep batching."""
