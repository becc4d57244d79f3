"""Timing of work queued on a device, for the adaptive speculation lengths (speculation_length.py).

On a GPU the host clock measures how long it took to queue the work, not to do it: a drafter whose tokens stay on
the device returns as soon as its kernels are launched. CUDA events recorded between the launches time the work
itself; on the CPU, where work is done when the call returns, the host clock does.
"""

import time

import torch

Mark = float | torch.cuda.Event


class DeviceClock:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Mark:
        """A moment in the device's queue of work (its current stream): now, on the CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds of work between two marks, to be asked once the device has read past end (a verification's
        read): waiting for end then waits for nothing."""
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000
