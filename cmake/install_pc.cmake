# Run by `cmake --install` (install(CODE) in CMakeLists.txt), so that
# chorus.pc and chorus-train.pc name the prefix actually installed to:
# `--prefix P` at install time, or the configured one.  A library folder
# the dynamic linker does not search by default gets an rpath in Libs, so
# that `cc prog.c $(pkg-config --cflags --libs chorus)` runs without
# LD_LIBRARY_PATH; installing as root into /usr or /usr/local runs
# ldconfig.  Inputs: CHORUS_PC_SRC, CHORUS_PC_LIBDIR, CHORUS_PC_INCLUDEDIR,
# CHORUS_PC_VERSION, CHORUS_PC_MULTIARCH.
set(prefix "${CMAKE_INSTALL_PREFIX}")
foreach(d LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CHORUS_PC_${d}}")
    set(_chorus_${d} "${CHORUS_PC_${d}}")
  else()
    set(_chorus_${d} "${prefix}/${CHORUS_PC_${d}}")
  endif()
endforeach()
set(libdir "${_chorus_LIBDIR}")
set(includedir "${_chorus_INCLUDEDIR}")
set(version "${CHORUS_PC_VERSION}")
set(_chorus_system_dirs /lib /usr/lib /lib64 /usr/lib64)
if(CHORUS_PC_MULTIARCH)
  list(APPEND _chorus_system_dirs /lib/${CHORUS_PC_MULTIARCH} /usr/lib/${CHORUS_PC_MULTIARCH})
endif()
set(rpath " -Wl,-rpath,\${libdir}")
foreach(d ${_chorus_system_dirs}) # (no IN_LIST: an install script has no policies set)
  if(libdir STREQUAL d)
    set(rpath "")
  endif()
endforeach()
foreach(pc chorus chorus-train)
  set(_chorus_out "$ENV{DESTDIR}${libdir}/pkgconfig/${pc}.pc")
  configure_file("${CHORUS_PC_SRC}/${pc}.pc.in" "${_chorus_out}" @ONLY)
  message(STATUS "Installing: ${_chorus_out}")
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${_chorus_out}")
endforeach()
if("$ENV{DESTDIR}" STREQUAL "" AND (prefix STREQUAL "/usr" OR prefix STREQUAL "/usr/local"))
  execute_process(COMMAND id -u OUTPUT_VARIABLE _chorus_uid OUTPUT_STRIP_TRAILING_WHITESPACE)
  find_program(_chorus_ldconfig ldconfig PATHS /sbin /usr/sbin)
  if(_chorus_uid STREQUAL "0" AND _chorus_ldconfig)
    execute_process(COMMAND ${_chorus_ldconfig})
    message(STATUS "chorus: ran ldconfig (libchorus is now found without an rpath)")
  endif()
endif()
