"""The packing engine on plain arrays: Numba kernels, plans, the Arrow door and the gather.

Nothing here imports from any other packtools subpackage (only ``packtools.errors`` and
``packtools.constants``).
"""
