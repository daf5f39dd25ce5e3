"""Pipeline parallelism, framework-free: which layers each stage holds (`stages`), the
schedules as explicit per-stage slot lists and what they cost (`schedule`). A backend runs the
slots it is given and moves the activations; it decides none of this."""
