"""vfesim_kernels: numeric kernels (numbers and arrays only: no configs, no xarray, no I/O).

Installed from the repository's ``kernels/`` folder under the import name ``vfesim_kernels``.
"""
