"""The scheduler: request queues, step planning under a token budget, preemption, output fan-out."""
