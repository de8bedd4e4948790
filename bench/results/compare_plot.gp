set terminal pngcairo size 1200,500 font ',10' noenhanced
set output '/work/main/bench/results/compare.png'
set datafile missing 'nan'
set multiplot layout 1,2 title 'all_reduce float32 sum, busbw vs size (median of 3 repeats), vm'
set logscale xy
set grid
set key bottom right box opaque
set format y '%g'
set xrange [4:1.6e8]
set xlabel 'size (bytes)'
set ylabel 'busbw (GB/s)'
set xtics ('8 B' 8, '64 KiB' 65536, '1 MiB' 1048576, '16 MiB' 16777216, '64 MiB' 67108864)
do for [i=0:1] {
  set title sprintf('%d ranks', i==0 ? 2 : 4)
  plot '/work/main/bench/results/compare_plot.dat' index i using 1:3 with linespoints lw 2 title 'chorus', \
       '' index i using 1:4 with linespoints title 'Open MPI', \
       '' index i using 1:5 with linespoints title 'MPICH', \
       '' index i using 1:6 with linespoints title 'Gloo', \
       '' index i using 1:2 with lines dt 2 lc rgb 'black' title 'memory-bandwidth bound'
}
unset multiplot
