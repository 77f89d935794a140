"""What work costs on the modelled hardware, one piece at a time: a task's compute (roofline, matmuls by
shape, the published speeds of attention and grouped-matmul kernels), transfers sharing links
(max-min fair), and the wait of devices that meet at a shared host's barriers.
"""
