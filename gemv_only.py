import sys, warnings
sys.path[:0] = [".", "benchmarks"]
warnings.simplefilter("ignore")
from decode import gemv_table, read_bandwidth
gemv_table(read_bandwidth(), 30, stages=(4, 5))
