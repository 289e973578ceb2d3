"""The optimizer step behind the seam of offload/step_seam.py: the device driver over a
torch optimizer (device.py) and the offloaded CPU Adam (offloaded.py, deciding when;
offloaded_adam.py, the update, through one runner: streamed.py over offload.AdamStream,
or in place when the state is in host memory, in_place.py); learning-rate schedules and
loss scaling / gradient statistics (step/lr_schedules.py, step/precision.py)."""
