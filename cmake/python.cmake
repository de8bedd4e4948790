# python.cmake - the Python package and the PyTorch backend (included by
# the top-level CMakeLists.txt).
#
#   -DCHORUS_PYTHON=OFF          skip both
#   -DCHORUS_PYTHON_EXECUTABLE=  the interpreter to build for (default
#                                /usr/bin/python3: Debian's, which has torch)
#   -DCHORUS_TORCH=OFF           skip the torch backend only
#   -DCHORUS_PYTHON_ORIGIN=ON    self-contained package (setup.py): the
#                                extensions find libchorus next to them
#
# Outputs: ${CMAKE_BINARY_DIR}/python/chorus/ holds links to python/chorus/*.py,
# _chorus<EXT_SUFFIX> and, with torch, _torch<EXT_SUFFIX>.
option(CHORUS_PYTHON "Build the Python package (python/)" ON)
option(CHORUS_TORCH "Build the PyTorch backend (needs python3-torch, libtorch-dev, pybind11-dev)" ON)
option(CHORUS_PYTHON_ORIGIN "Extensions load libchorus from their own folder" OFF)
if(EXISTS /usr/bin/python3)
  set(_chorus_py_default /usr/bin/python3)
else()
  find_program(_chorus_py_default python3)
endif()
set(CHORUS_PYTHON_EXECUTABLE "${_chorus_py_default}" CACHE FILEPATH "Python to build for")

set(CHORUS_PYTHON_BUILT OFF)
set(CHORUS_TORCH_BUILT OFF)
if(NOT CHORUS_PYTHON)
  return()
endif()
if(CHORUS_SANITIZE OR CHORUS_FUZZ)
  message(STATUS "chorus: Python package not built in sanitizer/fuzz builds")
  return()
endif()
if(NOT CHORUS_PYTHON_EXECUTABLE)
  message(STATUS "chorus: no python3: the Python package is not built")
  return()
endif()
execute_process(
  COMMAND ${CHORUS_PYTHON_EXECUTABLE} -c
    "import sysconfig; print(sysconfig.get_paths()['include']); print(sysconfig.get_config_var('EXT_SUFFIX'))"
  OUTPUT_VARIABLE _chorus_py_out RESULT_VARIABLE _chorus_py_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _chorus_py_rc EQUAL 0)
  message(STATUS "chorus: ${CHORUS_PYTHON_EXECUTABLE} does not run: the Python package is not built")
  return()
endif()
string(REPLACE "\n" ";" _chorus_py_out "${_chorus_py_out}")
list(GET _chorus_py_out 0 CHORUS_PYTHON_INCLUDE)
list(GET _chorus_py_out 1 CHORUS_PYTHON_EXT_SUFFIX)
if(NOT EXISTS "${CHORUS_PYTHON_INCLUDE}/Python.h")
  message(STATUS "chorus: Python.h not found in ${CHORUS_PYTHON_INCLUDE} (python3-dev): "
                 "the Python package is not built")
  return()
endif()

set(CHORUS_PYTHON_DIR ${CMAKE_BINARY_DIR}/python)
file(MAKE_DIRECTORY ${CHORUS_PYTHON_DIR}/chorus)
# The pure-Python files, linked so edits need no rebuild.
file(GLOB _chorus_py_files CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/python/chorus/*.py)
foreach(f ${_chorus_py_files})
  get_filename_component(n ${f} NAME)
  file(CREATE_LINK ${f} ${CHORUS_PYTHON_DIR}/chorus/${n} SYMBOLIC)
endforeach()

function(chorus_python_module target name)
  set_target_properties(${target} PROPERTIES
    OUTPUT_NAME ${name} PREFIX "" SUFFIX "${CHORUS_PYTHON_EXT_SUFFIX}"
    LIBRARY_OUTPUT_DIRECTORY ${CHORUS_PYTHON_DIR}/chorus)
  target_include_directories(${target} SYSTEM PRIVATE ${CHORUS_PYTHON_INCLUDE})
  target_link_libraries(${target} PRIVATE chorus)
  if(CHORUS_PYTHON_ORIGIN)
    set_target_properties(${target} PROPERTIES BUILD_RPATH "$ORIGIN" INSTALL_RPATH "$ORIGIN"
                          SKIP_BUILD_RPATH OFF BUILD_WITH_INSTALL_RPATH ON)
    add_custom_command(TARGET ${target} POST_BUILD
      COMMAND ${CMAKE_COMMAND} -E copy $<TARGET_FILE:chorus> ${CHORUS_PYTHON_DIR}/chorus/$<TARGET_SONAME_FILE_NAME:chorus>)
  endif()
endfunction()

add_library(chorus_python MODULE python/chorus/_chorus.c python/chorus/_chorus_comm.c
            python/chorus/_chorus_coll.c python/chorus/_chorus_store.c)
chorus_python_module(chorus_python _chorus)
# Only PyInit__chorus leaves the module (PyMODINIT_FUNC exports it): the
# chorus__ names its files share stay inside.
set_target_properties(chorus_python PROPERTIES C_VISIBILITY_PRESET hidden)

# `cmake --install` puts the package where this interpreter looks for the
# install prefix: Debian's python3 reads /usr/lib/python3/dist-packages and
# /usr/local/lib/python3.X/dist-packages; another prefix P needs
# PYTHONPATH=P/<CHORUS_PYTHON_INSTALL_DIR>.  The extensions find the
# installed libchorus through an rpath relative to it.
execute_process(
  COMMAND ${CHORUS_PYTHON_EXECUTABLE} -c
    "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]); print(int('deb_system' in sysconfig.get_scheme_names()))"
  OUTPUT_VARIABLE _chorus_py_ver OUTPUT_STRIP_TRAILING_WHITESPACE)
string(REPLACE "\n" ";" _chorus_py_ver "${_chorus_py_ver}")
list(GET _chorus_py_ver 0 _chorus_py_xy)
list(GET _chorus_py_ver 1 _chorus_py_debian)
if(_chorus_py_debian AND CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(_chorus_py_dir lib/python3/dist-packages)
elseif(_chorus_py_debian)
  set(_chorus_py_dir lib/python${_chorus_py_xy}/dist-packages)
else()
  set(_chorus_py_dir lib/python${_chorus_py_xy}/site-packages)
endif()
set(CHORUS_PYTHON_INSTALL_DIR ${_chorus_py_dir} CACHE STRING
  "Where cmake --install puts the Python package, relative to the prefix")
file(RELATIVE_PATH _chorus_py_rpath /p/${CHORUS_PYTHON_INSTALL_DIR}/chorus /p/${CMAKE_INSTALL_LIBDIR})
function(chorus_python_install target)
  if(NOT CHORUS_PYTHON_ORIGIN)
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/${_chorus_py_rpath}")
    install(TARGETS ${target} LIBRARY DESTINATION ${CHORUS_PYTHON_INSTALL_DIR}/chorus)
  endif()
endfunction()
if(NOT CHORUS_PYTHON_ORIGIN)
  install(FILES ${_chorus_py_files} DESTINATION ${CHORUS_PYTHON_INSTALL_DIR}/chorus)
endif()
chorus_python_install(chorus_python)
set(CHORUS_PYTHON_BUILT ON)
file(WRITE ${CHORUS_PYTHON_DIR}/targets.txt "chorus_python\n") # for setup.py
message(STATUS "chorus: Python package for ${CHORUS_PYTHON_EXECUTABLE} in ${CHORUS_PYTHON_DIR}")

# ---------------------------------------------------------------- torch
if(NOT CHORUS_TORCH OR NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/python/chorus/_torch.cpp)
  return()
endif()
execute_process(
  COMMAND ${CHORUS_PYTHON_EXECUTABLE} -c
    "import torch, torch.utils.cpp_extension as e; print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(';'.join(e.include_paths()))"
  OUTPUT_VARIABLE _chorus_torch_out RESULT_VARIABLE _chorus_torch_rc ERROR_QUIET
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _chorus_torch_rc EQUAL 0)
  message(STATUS "chorus: torch not importable by ${CHORUS_PYTHON_EXECUTABLE} (python3-torch): "
                 "the PyTorch backend is not built")
  return()
endif()
string(REPLACE "\n" "|" _chorus_torch_out "${_chorus_torch_out}")
string(REGEX REPLACE "\\|.*" "" CHORUS_TORCH_ABI "${_chorus_torch_out}")
string(REGEX REPLACE "^[^|]*\\|" "" CHORUS_TORCH_INCLUDES "${_chorus_torch_out}")
find_path(CHORUS_PYBIND11_INCLUDE pybind11/pybind11.h)
find_library(CHORUS_TORCH_PYTHON_LIB torch_python)
if(NOT CHORUS_PYBIND11_INCLUDE OR NOT CHORUS_TORCH_PYTHON_LIB)
  message(STATUS "chorus: pybind11-dev or libtorch-dev missing: the PyTorch backend is not built")
  return()
endif()
enable_language(CXX)
add_library(chorus_torch MODULE python/chorus/_torch.cpp python/chorus/_torch_tensors.cpp
            python/chorus/_torch_work.cpp python/chorus/_torch_coll.cpp python/chorus/_torch_p2p.cpp)
chorus_python_module(chorus_torch _torch)
set_target_properties(chorus_torch PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON
                      CXX_EXTENSIONS OFF CXX_VISIBILITY_PRESET hidden)
# Debian's torch decides the C++ ABI; its pybind11 must be the one torch._C
# was built with (same internals), which Debian's pybind11-dev is.
target_compile_definitions(chorus_torch PRIVATE _GLIBCXX_USE_CXX11_ABI=${CHORUS_TORCH_ABI}
                           TORCH_EXTENSION_NAME=_torch TORCH_API_INCLUDE_EXTENSION_H)
target_include_directories(chorus_torch SYSTEM PRIVATE ${CHORUS_TORCH_INCLUDES}
                           ${CHORUS_PYBIND11_INCLUDE})
target_link_libraries(chorus_torch PRIVATE c10 torch torch_cpu torch_python)
chorus_python_install(chorus_torch)
set(CHORUS_TORCH_BUILT ON)
file(APPEND ${CHORUS_PYTHON_DIR}/targets.txt "chorus_torch\n")
message(STATUS "chorus: PyTorch backend (C++ ABI ${CHORUS_TORCH_ABI})")
