# cmake -DDIR=<folder> -DWANT=<a;b;c> -P build_output.cmake: the folder
# holds exactly the files WANT names.
file(GLOB found RELATIVE ${DIR} ${DIR}/*)
list(SORT found)
set(want ${WANT})
list(SORT want)
if(NOT found STREQUAL want)
  string(REPLACE ";" " " found "${found}")
  string(REPLACE ";" " " want "${want}")
  message(FATAL_ERROR "${DIR} holds: ${found}\nwant only: ${want}")
endif()
message(STATUS "${DIR}: ${found}")
