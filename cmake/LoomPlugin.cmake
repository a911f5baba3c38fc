# loom_add_plugin(NAME <name> [KIND <kind>] [TIER cxx|c] SOURCES <file>...
#                 [LINK_LIBRARIES <lib>...] [OUTPUT_DIRECTORY <dir>])
#
# Builds a Loom plugin: a MODULE library named libloom_<kind>_<name>.so (libloom_<name>.so
# without KIND, for a plugin whose components are of several kinds) that links the SDK (nothing of
# the host), compiled with hidden visibility, whose only exported symbol is the entry point
# loom_plugin_entry_v1, and linked with -z defs so an unresolved symbol fails the link instead of
# the load. TIER cxx (the default) links loom::sdk (LibTorch, libloom_sdk); TIER c links
# loom::sdk_c only (c_plugin.h: no LibTorch, no C++). The same function serves Loom's own tree
# and plugins built out of tree after find_package(LoomSDK).
#
# KIND, when given, is one of model, dataset, precision, memory, parallel, optimizer, schedule,
# callback; the loader reads the kinds from the plugin itself, the name only helps people (and
# lets `loom train` quote the refusal of libloom_<kind>_<name>.so when <name> is missing).
# OUTPUT_DIRECTORY defaults to LOOM_PLUGIN_OUTPUT_DIRECTORY when set (Loom's tree sets it to its
# plugin folder).
include_guard(GLOBAL)

set(_LOOM_PLUGIN_CMAKE_DIR "${CMAKE_CURRENT_LIST_DIR}")

# The function keeps the policies in effect where it is defined: its own (IN_LIST), whatever the
# caller's cmake_minimum_required says, or none (a project without one got "if given arguments
# ... Unknown arguments specified" from inside this file).
cmake_policy(PUSH)
cmake_policy(VERSION 3.25)
function(loom_add_plugin)
  cmake_parse_arguments(ARG "" "NAME;KIND;TIER;OUTPUT_DIRECTORY" "SOURCES;LINK_LIBRARIES" ${ARGN})
  if(NOT ARG_NAME OR NOT ARG_SOURCES)
    message(FATAL_ERROR "loom_add_plugin: NAME and SOURCES are required")
  endif()
  set(_kinds model dataset precision memory parallel optimizer schedule callback)
  if(ARG_KIND AND NOT ARG_KIND IN_LIST _kinds)
    message(FATAL_ERROR "loom_add_plugin(${ARG_NAME}): KIND '${ARG_KIND}' is not one of ${_kinds}")
  endif()
  if(NOT ARG_TIER)
    set(ARG_TIER cxx)
  endif()
  if(NOT ARG_TIER MATCHES "^(cxx|c)$")
    message(FATAL_ERROR "loom_add_plugin(${ARG_NAME}): TIER '${ARG_TIER}' is not cxx or c")
  endif()
  if(NOT ARG_NAME MATCHES "^[a-z][a-z0-9_]*$")
    message(FATAL_ERROR "loom_add_plugin: NAME '${ARG_NAME}' must be lower_snake_case")
  endif()

  if(ARG_KIND)
    set(_target loom_${ARG_KIND}_${ARG_NAME})
  else()
    set(_target loom_${ARG_NAME})
  endif()
  add_library(${_target} MODULE ${ARG_SOURCES})
  if(ARG_TIER STREQUAL "c")
    target_link_libraries(${_target} PRIVATE loom::sdk_c ${ARG_LINK_LIBRARIES})
  else()
    target_link_libraries(${_target} PRIVATE loom::sdk ${ARG_LINK_LIBRARIES})
  endif()
  set_target_properties(${_target} PROPERTIES
    PREFIX "lib"
    OUTPUT_NAME ${_target}
    CXX_VISIBILITY_PRESET hidden
    C_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    LINK_DEPENDS "${_LOOM_PLUGIN_CMAKE_DIR}/loom_plugin.map")
  target_link_options(${_target} PRIVATE
    "LINKER:-z,defs"
    "LINKER:--exclude-libs,ALL"
    "LINKER:--version-script=${_LOOM_PLUGIN_CMAKE_DIR}/loom_plugin.map")
  if(NOT ARG_OUTPUT_DIRECTORY AND LOOM_PLUGIN_OUTPUT_DIRECTORY)
    set(ARG_OUTPUT_DIRECTORY "${LOOM_PLUGIN_OUTPUT_DIRECTORY}")
  endif()
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${_target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIRECTORY}")
  endif()
  set_property(GLOBAL APPEND PROPERTY LOOM_PLUGIN_TARGETS ${_target})
endfunction()
cmake_policy(POP)
